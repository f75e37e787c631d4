"""KV-cache generation: the same greedy tokens as the recompute loop on every backend, past
block_size too, with multi-head and with grouped-query heads and a sliding window; what the
prefill and the decode steps call attention with; a cache of n_kv_head heads (a quarter of the
bytes at n_head / n_kv_head = 4); sample.py end to end."""
import inspect
import re

import pytest
import torch

import model as model_module
from attention import BACKENDS
from conftest import default_run, run_script
from model import GPT, GPTConfig

# Grouped-query heads (two query heads per kv head) and a window of 5 keys before each query:
# shorter than the 16-token block, so that the window hides keys in training, prefill and decode.
GQA_WINDOW = dict(n_head=4, n_kv_head=2, window=5)


def context_sensitive_gpt(attn, **overrides):
    """A tiny random model whose next token depends on its context. At GPT-2's init
    (std 0.02) a random model repeats one token whatever it is shown, so a broken cache
    would still pass; with std 0.5 matrices it does not."""
    torch.manual_seed(0)
    args = dict(block_size=16, vocab_size=50257, n_layer=2, n_head=2, n_embd=32, dropout=0.0, attn=attn)
    gpt = GPT(GPTConfig(**{**args, **overrides}))
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return gpt.eval()


def prompt(batch=2, length=5, vocab_size=50257):
    """Token ids below vocab_size: context_sensitive_gpt's vocabulary by default; pass another
    model's (gpt.config.vocab_size), or its embedding reads outside its table."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


# triton_fwd generates with triton's kernels (it differs in the backward alone), and the triton
# kernels' multi-head decode is one case of the grouped one (tests/test_decode.py checks both):
# the default run generates with triton's grouped heads and window; `pytest -m full`, the rest.
@default_run(lambda case: case.attn not in ("triton", "triton_fwd") or (case.attn, case.heads) == ("triton", "gqa+window"))
@pytest.mark.parametrize("heads", ["multi-head", "gqa+window"])
@pytest.mark.parametrize("attn", BACKENDS)
def test_greedy_tokens_are_the_same_with_and_without_the_cache_past_block_size(attn, heads):
    gpt = context_sensitive_gpt(attn, **(GQA_WINDOW if heads == "gqa+window" else {}))
    # 5 + 20 tokens: a prefill, 11 single-token steps, then 8 steps past block_size=16.
    without = gpt.generate(prompt(), max_new_tokens=20, top_k=1, kv_cache=False)
    with_cache = gpt.generate(prompt(), max_new_tokens=20, top_k=1, kv_cache=True)
    assert without.shape == (2, 25)
    assert torch.equal(with_cache, without)
    # The comparison means something only if the tokens vary with the context.
    assert all(len(set(row[5:].tolist())) > 10 for row in without)


def test_the_window_changes_what_the_cached_decode_draws():
    # The cached tokens of a windowed model differ from those of the same weights without the
    # window: the decode steps do hide the keys before the window (else both would agree).
    windowed = context_sensitive_gpt("eager", **GQA_WINDOW).generate(prompt(), max_new_tokens=10, top_k=1)
    unbounded = context_sensitive_gpt("eager", **{**GQA_WINDOW, "window": -1}).generate(prompt(), max_new_tokens=10,
                                                                                        top_k=1)
    assert not torch.equal(windowed, unbounded)


def recorder(real, name, seen, describe):
    """real, wrapped to append describe(its bound arguments) to seen at each call."""
    signature = inspect.signature(real)

    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append((name, *describe(bound.arguments)))
        return real(*args, **kwargs)
    return recording


@pytest.mark.parametrize("heads", ["multi-head", "gqa+window"])
def test_the_prefill_is_causal_and_each_step_sees_the_cached_keys_up_to_its_own(monkeypatch, heads):
    overrides = GQA_WINDOW if heads == "gqa+window" else {}
    n_head, n_kv_head, window = overrides.get("n_head", 2), overrides.get("n_kv_head", 2), overrides.get("window", -1)
    seen = []
    monkeypatch.setattr(model_module, "attention", recorder(
        model_module.attention, "attention", seen,
        lambda a: (a["q"].shape[1:3], a["k"].shape[1:3], a["v"].shape[1:3], a["is_causal"], a["window_size"])))
    monkeypatch.setattr(model_module, "decode_attention", recorder(
        model_module.decode_attention, "decode", seen,
        lambda a: (a["q"].shape[1:3], a["k"].shape[1:3], a["k_cache"].shape[1:3], a["v_cache"].shape[1:3],
                   a["pos"].item(), a["window_size"])))
    gpt = context_sensitive_gpt("sdpa", **overrides)
    gpt.generate(prompt(length=14), max_new_tokens=4, top_k=1)
    calls = seen[::2]  # layer 0 of each step; layer 1 makes the same call
    assert seen[1::2] == calls
    H, H_kv, left = n_head, n_kv_head, window
    assert calls == [
        # prefill: queries and keys are the same 14 tokens, H query heads against H_kv kv heads
        ("attention", (H, 14), (H_kv, 14), (H_kv, 14), True, (left, 0)),
        # the new token goes in at position 14 of the (H_kv, block_size) cache and sees keys [14 - left, 14]
        ("decode", (H, 1), (H_kv, 1), (H_kv, 16), (H_kv, 16), 14, (left, 0)),
        ("decode", (H, 1), (H_kv, 1), (H_kv, 16), (H_kv, 16), 15, (left, 0)),  # the cache is now full
        ("attention", (H, 16), (H_kv, 16), (H_kv, 16), True, (left, 0)),  # so it is refilled from the last 16 tokens
    ]


def cache_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in layer)


@pytest.mark.parametrize("n_kv_head", [8, 4, 2, 1])
def test_the_cache_holds_n_kv_head_heads(n_kv_head):
    # n_layer * (k and v) * B * n_kv_head * block_size * head_dim values of 4 bytes (float32).
    gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=8, n_kv_head=n_kv_head, n_embd=64))
    cache = gpt.new_cache(batch_size=5)
    assert len(cache.layers) == 3
    assert all(t.shape == (5, n_kv_head, 16, 8) for layer in cache.layers for t in layer)
    assert cache_bytes(cache) == 3 * 2 * 5 * n_kv_head * 16 * 8 * 4
    # generate's own cache is the same
    gpt.eval().generate(torch.randint(0, 64, (5, 3)), max_new_tokens=2, top_k=1)
    assert cache_bytes(gpt.generate_decoder.cache) == cache_bytes(cache)


def test_grouped_query_heads_at_four_queries_per_kv_head_cache_a_quarter_of_the_bytes():
    config = dict(block_size=64, vocab_size=64, n_layer=2, n_head=8, n_embd=128)
    multi_head = GPT(GPTConfig(**config)).new_cache(batch_size=2, dtype=torch.bfloat16)
    grouped = GPT(GPTConfig(**config, n_kv_head=2)).new_cache(batch_size=2, dtype=torch.bfloat16)
    assert cache_bytes(multi_head) == 2 * 2 * 2 * 8 * 64 * 16 * 2  # n_kv_head defaults to n_head
    assert cache_bytes(grouped) == 2 * 2 * 2 * 2 * 64 * 16 * 2
    assert cache_bytes(grouped) * 4 == cache_bytes(multi_head)


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
    assert lines[0].startswith("decode: batch 2, 1-token prompt, 2 new tokens, block_size 64, 2 query heads, cpu")
    assert lines[1].split() == ["attn", "kv", "heads", "no", "cache", "tok/s", "kv", "cache", "tok/s", "speedup"]
    # On the CPU the Triton backends are left out (the interpreter would time numpy, slowly).
    assert [line.split()[0] for line in lines[2:]] == [b for b in BACKENDS if b not in ("triton", "triton_fwd")]
    for line in lines[2:]:
        no_cache, cached, speedup = line.split()[-3:]
        assert float(no_cache.replace(",", "")) > 0 and float(cached.replace(",", "")) > 0 and speedup.endswith("x")


def test_sample_benchmark_of_a_random_model_of_the_gpu_run_shape():
    result = run_script("sample.py", "--init_from=random", "--benchmark=True", "--attn=sdpa", "--max_new_tokens=2",
                        "--num_samples=1", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert "random-init model" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("decode: batch 1, 1-token prompt, 2 new tokens, block_size 512, 12 query heads, cpu")
    assert len(lines) == 3 and lines[2].split()[:5] == ["sdpa", "12", "(G", "=", "1)"]


def test_sample_benchmark_of_grouped_heads_times_one_kv_head_per_query_head_beside_it():
    """docs/learn.md's chapter 6 compares a model of 3 kv heads for 12 query heads with G = 1."""
    result = run_script("sample.py", "--init_from=random", "--n_kv_head=3", "--benchmark=True", "--attn=sdpa",
                        "--max_new_tokens=2", "--num_samples=1", "--device=cpu")
    assert result.returncode == 0, result.stderr
    rows = [line.split()[:5] for line in result.stdout.splitlines()[2:]]
    assert rows == [["sdpa", "3", "(G", "=", "4)"], ["sdpa", "12", "(G", "=", "1)"]]
