"""decode_attention: one new query per sequence against a static KV cache, every backend
against float64 eager, with n_keys a device tensor; and a compiled decode step that draws
exactly the tokens of the uncompiled one."""
import pytest
import torch

from attention import BACKENDS, decode_attention
from attention.decode import eager_decode_attention
from model import GPT, GPTConfig
from test_kv_cache import context_sensitive_gpt, prompt
from torch._dynamo.testing import CompileCounter  # imports triton: after attention, which picks the interpreter

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cache_inputs(B, H, S, D, dtype, device="cpu", seed=0):
    """q as the model makes it, a strided (B, H, 1, D) view of a fused projection; the caches
    (B, H, S, D) with random values everywhere, also past the keys a query may see, so that a
    backend reading past n_keys gets a wrong answer."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, 1, 3, H, D, generator=g).to(device, dtype)
    q = qkv[:, :, 0].transpose(1, 2)
    k_cache, v_cache = (torch.randn(B, H, S, D, generator=g).to(device, dtype) for _ in range(2))
    return q, k_cache, v_cache


def expected(q, k_cache, v_cache, n_keys):
    """float64 eager on the visible keys alone, sliced on the host: no mask involved."""
    rows = [torch.softmax(q[b].double() @ k_cache[b, :, :n].double().transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
            @ v_cache[b, :, :n].double() for b, n in enumerate(n_keys.expand(q.shape[0]).tolist())]
    return torch.stack(rows)


# (B, H, S, D, n_keys): odd cache lengths, a count per sequence or one for all, the first key
# alone, a full cache, and counts that end inside a 64-key tile and exactly at its end.
SHAPES = [
    (3, 2, 37, 16, [1, 20, 37]),
    (2, 3, 130, 32, [64, 129]),
    (1, 1, 5, 64, 5),
    (2, 2, 70, 16, 3),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, H, S, D, n", SHAPES)
def test_decode_attention_matches_float64_on_the_visible_keys(backend, dtype, B, H, S, D, n):
    q, k_cache, v_cache = cache_inputs(B, H, S, D, dtype)
    n_keys = torch.tensor(n)
    o = decode_attention(q, k_cache, v_cache, n_keys, backend=backend)
    assert o.shape == q.shape and o.dtype == dtype
    torch.testing.assert_close(o.double(), expected(q, k_cache, v_cache, n_keys), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_the_eager_reference_masks_what_the_slices_leave_out():
    q, k_cache, v_cache = cache_inputs(2, 2, 9, 16, torch.float64)
    n_keys = torch.tensor([4, 9])
    torch.testing.assert_close(eager_decode_attention(q, k_cache, v_cache, n_keys), expected(q, k_cache, v_cache, n_keys))


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.randn(1, 2, 2, 16)), r"q must have shape \(B, H, 1, D\)"),
    (dict(n_keys=torch.tensor(3.0)), "n_keys must be an integer torch.Tensor"),
    (dict(n_keys=3), "n_keys must be an integer torch.Tensor"),
    (dict(n_keys=torch.tensor([3, 4, 5])), r"n_keys must have shape \(\) or \(B,\) = \(1,\)"),
    (dict(k_cache=torch.randn(1, 2, 8, 32)), "head dim 32 must equal q's head dim 16"),
])
def test_bad_decode_inputs_are_named(bad, message):
    args = dict(q=torch.randn(1, 2, 1, 16), k_cache=torch.randn(1, 2, 8, 16), v_cache=torch.randn(1, 2, 8, 16),
                n_keys=torch.tensor(3))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        decode_attention(**args, backend="eager")



def test_an_unknown_decode_backend_is_named():
    with pytest.raises(ValueError, match="backend='flash' is not one of"):
        decode_attention(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.tensor(3),
                         backend="flash")


def test_the_triton_decode_operator_passes_opcheck():
    q, k_cache, v_cache = cache_inputs(2, 2, 19, 16, torch.float32)
    torch.library.opcheck(torch.ops.nanofa2.triton_decode_attention.default, (q, k_cache, v_cache, torch.tensor([7, 19])))


@pytest.mark.parametrize("attn", ["eager", "triton", "sdpa"])
def test_a_compiled_decode_step_draws_the_tokens_of_the_uncompiled_one(attn):
    # The step compiles as one graph (fullgraph=True: the Triton kernel is an opaque custom
    # operator) and is used for every token after the prefill, across the refill at block_size.
    torch._dynamo.reset()
    gpt = context_sensitive_gpt(attn)
    eager_tokens = gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    gpt.compile_decode_step(backend="aot_eager")
    compiled_tokens = gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    assert torch.equal(compiled_tokens, eager_tokens)
    assert all(len(set(row[5:].tolist())) > 6 for row in eager_tokens)


def test_the_decode_step_compiles_once_across_tokens_refills_and_generate_calls():
    # Dynamo recompiles when an input's shape, stride or offset changes; a step fed idx[:, -1:],
    # a view into the growing idx, recompiled at every token until the recompile limit.
    torch._dynamo.reset()
    gpt = context_sensitive_gpt("eager")
    compiles = CompileCounter()
    gpt.compile_decode_step(backend=compiles)
    for _ in range(2):  # 5 + 14 tokens: past block_size=16, so each call also refills the cache
        gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    assert compiles.frame_count == 1
    gpt.generate(prompt(batch=3), max_new_tokens=4, top_k=1)  # a new batch size: one static graph more
    assert compiles.frame_count == 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, H, S, D, n", SHAPES + [(32, 6, 256, 64, 200), (1, 6, 256, 128, 256)])
def test_decode_attention_on_the_gpu_in_bfloat16(backend, B, H, S, D, n):
    q, k_cache, v_cache = cache_inputs(B, H, S, D, torch.bfloat16, device="cuda")
    n_keys = torch.tensor(n, device="cuda")
    o = decode_attention(q, k_cache, v_cache, n_keys, backend=backend)
    torch.testing.assert_close(o.double(), expected(q, k_cache, v_cache, n_keys), atol=2e-2, rtol=2e-2)


def uncaptured_greedy(gpt, tokens, max_new_tokens):
    """Greedy decoding by hand: a prefill, then gpt.decode_step called directly, token by token,
    with no StaticDecoder and so no CUDA graph (within block_size: no refill)."""
    cache = gpt.new_cache(tokens.size(0))
    logits, _ = gpt(tokens, cache=cache)
    for _ in range(max_new_tokens):
        next_token = logits[:, -1, :gpt.config.vocab_size].argmax(dim=-1, keepdim=True)
        tokens = torch.cat((tokens, next_token), dim=1)
        logits = gpt.decode_step(next_token, torch.tensor([cache.length], device=tokens.device), cache)
        cache.length += 1
    return tokens


@pytest.mark.gpu
@pytest.mark.parametrize("attn", BACKENDS)
def test_a_cuda_graph_decode_draws_the_tokens_of_the_uncaptured_one(attn):
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, attn=attn)).cuda().eval()
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
        tokens = prompt(batch=3).cuda()
        expected_tokens = uncaptured_greedy(gpt, tokens, 20)
    assert all(len(set(row[5:].tolist())) > 10 for row in expected_tokens)
    # Captured uncompiled, then compiled; each twice: the first records the graph, the second
    # refills the same cache and replays it.
    for compiled in (False, True):
        if compiled:
            gpt.compile_decode_step()
        for _ in range(2):
            assert torch.equal(gpt.generate(tokens, max_new_tokens=20, top_k=1), expected_tokens)
