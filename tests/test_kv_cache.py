"""KV-cache generation: the same greedy tokens as the recompute loop on every backend, past
block_size too; what the prefill and the decode steps call attention with; sample.py end to end."""
import re

import pytest
import torch

import model as model_module
from attention import BACKENDS
from conftest import run_script
from model import GPT, GPTConfig


def context_sensitive_gpt(attn):
    """A tiny random model whose next token depends on its context. At GPT-2's init
    (std 0.02) a random model repeats one token whatever it is shown, so a broken cache
    would still pass; with std 0.5 matrices it does not."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=2, n_head=2, n_embd=32, dropout=0.0, attn=attn))
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return gpt.eval()


def prompt(batch=2, length=5):
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn", BACKENDS)
def test_greedy_tokens_are_the_same_with_and_without_the_cache_past_block_size(attn):
    gpt = context_sensitive_gpt(attn)
    # 5 + 20 tokens: a prefill, 11 single-token steps, then 8 steps past block_size=16.
    without = gpt.generate(prompt(), max_new_tokens=20, top_k=1, kv_cache=False)
    with_cache = gpt.generate(prompt(), max_new_tokens=20, top_k=1, kv_cache=True)
    assert without.shape == (2, 25)
    assert torch.equal(with_cache, without)
    # The comparison means something only if the tokens vary with the context.
    assert all(len(set(row[5:].tolist())) > 10 for row in without)


def test_the_prefill_is_causal_and_each_step_sees_the_cached_keys_up_to_its_own(monkeypatch):
    seen = []
    real_attention, real_decode_attention = model_module.packed_attention, model_module.decode_attention

    def recording_attention(qkv, is_causal, backend):
        seen.append(("attention", qkv.shape[1], is_causal))
        return real_attention(qkv, is_causal=is_causal, backend=backend)

    def recording_decode_attention(qkv, k_cache, v_cache, pos, backend):
        seen.append(("decode", qkv.shape[1], k_cache.shape[-2], pos.item()))
        return real_decode_attention(qkv, k_cache, v_cache, pos, backend=backend)

    monkeypatch.setattr(model_module, "packed_attention", recording_attention)
    monkeypatch.setattr(model_module, "decode_attention", recording_decode_attention)
    gpt = context_sensitive_gpt("sdpa")
    gpt.generate(prompt(length=14), max_new_tokens=4, top_k=1)
    calls = seen[::2]  # layer 0 of each step; layer 1 makes the same call
    assert seen[1::2] == calls
    assert calls == [
        ("attention", 14, True),  # prefill: queries and keys are the same 14 tokens
        ("decode", 1, 16, 14),    # the new token goes in at position 14 and sees keys [0, 14]
        ("decode", 1, 16, 15),    # the cache is now full (block_size=16)
        ("attention", 16, True),  # so it is refilled from the last 16 tokens
    ]


def test_a_filled_cache_takes_one_token_and_stops_at_block_size():
    gpt = context_sensitive_gpt("eager")
    cache = gpt.new_cache(batch_size=2)
    gpt(prompt(length=15), cache=cache)
    with pytest.raises(ValueError, match="feed one token at a time"):
        gpt(prompt(length=2), cache=cache)
    gpt(prompt(length=1), cache=cache)
    with pytest.raises(ValueError, match=re.escape("(16 cached + 1 new) exceeds block_size=16")):
        gpt(prompt(length=1), cache=cache)
    with pytest.raises(ValueError, match="idx has batch 3 but the cache was made for batch 2"):
        gpt(prompt(batch=3, length=1), cache=gpt.new_cache(batch_size=2))


def test_sample_gives_the_same_text_with_and_without_the_cache(trained_out_dir):
    # Sampled, not greedy: greedy text from this 4-iteration model is all newlines, which a
    # broken cache would match too. With one seed both loops draw the same tokens, as their
    # logits differ only by float rounding. block_size is 64: ROMEO: and 70 tokens pass it.
    args = [f"--out_dir={trained_out_dir}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=70",
            "--device=cpu", "--seed=3"]
    with_cache = run_script("sample.py", *args, "--kv_cache=True")
    without = run_script("sample.py", *args, "--kv_cache=False")
    assert with_cache.returncode == 0, with_cache.stderr
    assert without.returncode == 0, without.stderr
    assert "kv_cache=True" in with_cache.stderr and "kv_cache=False" in without.stderr
    assert with_cache.stdout.startswith("ROMEO:") and len(set(with_cache.stdout.split())) > 20
    assert with_cache.stdout == without.stdout


def test_sample_benchmark_prints_a_row_per_backend(trained_out_dir):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", "--benchmark=True", "--max_new_tokens=2",
                        "--device=cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("decode: batch 2, 1-token prompt, 2 new tokens, block_size 64, cpu")
    assert lines[1].split() == ["attn", "no", "cache", "tok/s", "kv", "cache", "tok/s", "speedup"]
    assert [line.split()[0] for line in lines[2:]] == list(BACKENDS)
    for line in lines[2:]:
        _, no_cache, cached, speedup = line.split()
        assert float(no_cache.replace(",", "")) > 0 and float(cached.replace(",", "")) > 0 and speedup.endswith("x")


def test_sample_benchmark_of_a_random_model_of_the_gpu_run_shape():
    result = run_script("sample.py", "--init_from=random", "--benchmark=True", "--attn=sdpa", "--max_new_tokens=2",
                        "--num_samples=1", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert "random-init model" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("decode: batch 1, 1-token prompt, 2 new tokens, block_size 512, cpu")
    assert len(lines) == 3 and lines[2].split()[0] == "sdpa"
