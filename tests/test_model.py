"""model.py: causality, backend agreement, the q/k/v layout handed to attention, sampling."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import model as model_module
from model import GPT, GPTConfig


def small_gpt(attn="eager", seed=0, **overrides):
    torch.manual_seed(seed)
    args = dict(block_size=16, vocab_size=50257, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True, attn=attn)
    args.update(overrides)
    return GPT(GPTConfig(**args))


def random_tokens(batch=2, length=16, seed=1):
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_vocab_is_padded_and_embeddings_are_tied():
    gpt = small_gpt()
    assert gpt.lm_head.weight.shape == (50304, 32)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_changing_a_future_token_never_changes_earlier_logits(attn):
    gpt = small_gpt(attn).eval()
    idx = random_tokens()
    logits, _ = gpt(idx, targets=idx)
    changed_at = 9
    idx2 = idx.clone()
    idx2[:, changed_at] = (idx2[:, changed_at] + 1234) % 50257
    logits2, _ = gpt(idx2, targets=idx2)
    assert torch.equal(logits[:, :changed_at], logits2[:, :changed_at])
    assert not torch.allclose(logits[:, changed_at:], logits2[:, changed_at:])


def test_eager_and_sdpa_give_the_same_logits_and_gradients():
    results = {}
    for attn in ("eager", "sdpa"):
        gpt = small_gpt(attn, dropout=0.0).double()
        idx = random_tokens()
        logits, loss = gpt(idx, targets=torch.roll(idx, -1, dims=1))
        loss.backward()
        results[attn] = (logits, {name: p.grad for name, p in gpt.named_parameters()})
    (eager_logits, eager_grads), (sdpa_logits, sdpa_grads) = results["eager"], results["sdpa"]
    torch.testing.assert_close(sdpa_logits, eager_logits, rtol=1e-10, atol=1e-10)
    assert eager_grads.keys() == sdpa_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(sdpa_grads[name], eager_grads[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("attn", ["triton", "triton_fwd", "tiled"])
def test_a_compiled_model_matches_the_plain_model(attn):
    """The Triton backends are custom operators, so torch.compile traces the whole model as one
    graph (fullgraph=True fails on any graph break); tiled, a Python loop, may break the graph.
    Compiled, the logits, loss and every gradient are those of the plain model. aot_eager runs
    the traced forward and backward graphs without Inductor, as the CPU's kernels are interpreted."""
    idx = random_tokens(length=12) % 100
    results = []
    for compiled in (False, True):
        gpt = small_gpt(attn, vocab_size=100, n_embd=64)
        run = torch.compile(gpt, backend="aot_eager", fullgraph=attn != "tiled") if compiled else gpt
        logits, loss = run(idx, targets=idx)
        loss.backward()
        results.append((logits, loss.detach(), {name: p.grad for name, p in gpt.named_parameters()}))
    (logits, loss, grads), (logits_compiled, loss_compiled, grads_compiled) = results
    torch.testing.assert_close(logits_compiled, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_compiled, loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert grads["transformer.h.0.attn.c_attn.weight"].abs().sum() > 0


def test_a_compiled_backward_takes_no_gradient_for_the_training_logits():
    """Training differentiates the loss alone. Were the logits returned attached, the compiled
    backward would take a gradient for them too, which autograd fills with zeros: a
    (batch x block_size x vocab) fill at every step, and a read of it in the backward."""
    tangents = []

    def run_as_traced(graph, example_inputs):
        return make_boxed_func(graph.forward)

    def record_tangents(graph, example_inputs):
        tangents.append([node.name for node in graph.graph.nodes
                         if node.op == "placeholder" and node.name.startswith("tangents")])
        return run_as_traced(graph, example_inputs)

    backend = aot_autograd(fw_compiler=run_as_traced, bw_compiler=record_tangents)
    gpt = small_gpt(vocab_size=100)
    idx = random_tokens(length=12) % 100
    logits, loss = torch.compile(gpt, backend=backend, fullgraph=True)(idx, targets=idx)
    loss.backward()
    assert not logits.requires_grad and loss.requires_grad
    assert tangents == [["tangents_1"]]  # the loss's gradient only


def test_training_hands_attention_the_fused_projection(monkeypatch):
    seen = []
    real_packed_attention = model_module.packed_attention

    def recording_packed_attention(qkv, is_causal, backend):
        seen.append((qkv, is_causal, backend))
        return real_packed_attention(qkv, is_causal=is_causal, backend=backend)

    monkeypatch.setattr(model_module, "packed_attention", recording_packed_attention)
    gpt = small_gpt("sdpa")
    gpt(random_tokens(batch=3, length=10))
    assert len(seen) == 2  # one call per layer
    qkv, is_causal, backend = seen[0]
    assert (is_causal, backend) == (True, "sdpa")
    assert qkv.shape == (3, 10, 3, 2, 16)  # (B, T, 3, H, D): q, k, v = qkv.unbind(2)
    assert qkv.is_contiguous()  # a view of the c_attn output, not a copy
    assert qkv._base is not None


def test_unknown_backend_is_rejected_with_the_valid_ones():
    from attention import BACKENDS

    with pytest.raises(ValueError) as error:
        small_gpt("flash")
    assert all(name in str(error.value) for name in BACKENDS)


def test_weight_decay_applies_to_matrices_only():
    gpt = small_gpt()
    optimizer = gpt.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(gpt.parameters()))


def test_generate_crops_to_block_size_and_never_draws_padding_ids():
    gpt = small_gpt().eval()
    # Make the 47 padding ids by far the likeliest: the final LayerNorm outputs all ones
    # and only the padding rows of the output layer are non-zero.
    with torch.no_grad():
        gpt.transformer.ln_f.weight.zero_()
        gpt.transformer.ln_f.bias.fill_(1.0)
        gpt.lm_head.weight[:50257].zero_()
        gpt.lm_head.weight[50257:].fill_(1.0)
    out = gpt.generate(random_tokens(batch=1, length=5), max_new_tokens=30, top_k=None)
    assert out.shape == (1, 35)  # ran past block_size=16 by cropping the context
    assert int(out.max()) < 50257
