"""model.py: causality and the window's reach, backend agreement (a grouped-query, windowed
model trains alike on every backend), the q/k/v views handed to attention, one compiled graph,
the configuration checks, sampling."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import model as model_module
from attention import BACKENDS
from conftest import default_run
from model import GPT, GPTConfig
from test_kv_cache import GQA_WINDOW


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


@pytest.mark.parametrize("attn", BACKENDS)
def test_a_token_reaches_no_further_than_the_window_lets_it(attn):
    # Each layer lets a position see the window=3 keys before it, so after n_layer=2 layers a
    # token reaches the 2 * 3 positions after its own and no further: changing token 4 changes
    # the logits at positions 4 to 10 and leaves every other position's logits exactly as they were.
    gpt = small_gpt(attn, n_head=4, n_kv_head=2, window=3).eval()
    idx = random_tokens()
    idx2 = idx.clone()
    idx2[:, 4] = (idx2[:, 4] + 1234) % 50257
    with torch.no_grad():
        logits, _ = gpt(idx, targets=idx)
        logits2, _ = gpt(idx2, targets=idx2)
    assert torch.equal(logits[:, :4], logits2[:, :4]) and torch.equal(logits[:, 11:], logits2[:, 11:])
    assert all(not torch.allclose(logits[:, t], logits2[:, t]) for t in range(4, 11))


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


# The default run compiles triton with grouped heads and a window (its operators, as without);
# `pytest -m full` also without.
@default_run(lambda case: case.attn != "triton" or case.overrides)
@pytest.mark.parametrize("attn, overrides", [
    ("triton", {}), ("triton_fwd", {}), ("tiled", {}), ("triton", dict(n_head=4, n_kv_head=2, window=5))])
def test_a_compiled_model_matches_the_plain_model(attn, overrides):
    """The Triton backends are custom operators, so torch.compile traces the whole model as one
    graph (fullgraph=True fails on any graph break); tiled, a Python loop, may break the graph.
    Compiled, the logits, loss and every gradient are those of the plain model. aot_eager runs
    the traced forward and backward graphs without Inductor, as the CPU's kernels are interpreted."""
    idx = random_tokens(length=12) % 100
    results = []
    for compiled in (False, True):
        gpt = small_gpt(attn, vocab_size=100, n_embd=64, **overrides)
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


def test_a_compiled_triton_model_is_one_graph_with_an_opaque_kernel_call_per_layer():
    """Dynamo hands over one graph (fullgraph=True would fail on a break), which AOT autograd
    splits into one forward and one backward: the forward calls nanofa2::flash_forward once
    per layer, the backward nanofa2::flash_backward once per layer, each an opaque node that
    runs the kernel (through the interpreter here)."""
    graphs = []

    def record(kind):
        def compiler(graph, example_inputs):
            graphs.append((kind, [node.target for node in graph.graph.nodes if node.op == "call_function"]))
            return make_boxed_func(graph.forward)
        return compiler

    gpt = small_gpt("triton", vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, window=5)
    idx = random_tokens(length=12) % 100
    _, loss = torch.compile(gpt, backend=aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward")),
                            fullgraph=True)(idx, targets=idx)
    loss.backward()
    assert [kind for kind, _ in graphs] == ["forward", "backward"]
    ops = torch.ops.nanofa2
    (_, forward), (_, backward) = graphs
    assert forward.count(ops.flash_forward.default) == 3 and ops.flash_backward.default not in forward
    assert backward.count(ops.flash_backward.default) == 3 and ops.flash_forward.default not in backward
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gpt.parameters())


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


@pytest.mark.parametrize("heads", ["multi-head", "gqa+window"])
def test_training_hands_attention_views_of_the_fused_projection(monkeypatch, heads):
    overrides = dict(GQA_WINDOW, n_embd=64) if heads == "gqa+window" else {}
    H, H_kv, D = (4, 2, 16) if overrides else (2, 2, 16)
    window = overrides.get("window", -1)
    seen = []
    real_attention = model_module.attention

    def recording_attention(q, k, v, is_causal=False, backend="triton", window_size=(-1, -1)):
        seen.append((q, k, v, is_causal, backend, window_size))
        return real_attention(q, k, v, is_causal=is_causal, backend=backend, window_size=window_size)

    monkeypatch.setattr(model_module, "attention", recording_attention)
    gpt = small_gpt("sdpa", **overrides)
    gpt(random_tokens(batch=3, length=10))
    assert len(seen) == 2  # one call per layer
    q, k, v, is_causal, backend, window_size = seen[0]
    assert (is_causal, backend, window_size) == (True, "sdpa", (window, 0))
    assert q.shape == (3, H, 10, D) and k.shape == v.shape == (3, H_kv, 10, D)
    # (B, H, T, D) views of the c_attn output (B, T, H + 2 * H_kv, D), not copies: q's heads
    # first, then k's, then v's, one storage.
    width = (H + 2 * H_kv) * D
    assert q.stride() == k.stride() == v.stride() == (10 * width, D, width, 1)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert (k.data_ptr() - q.data_ptr(), v.data_ptr() - q.data_ptr()) == tuple(
        n * D * q.element_size() for n in (H, H + H_kv))


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


@pytest.mark.parametrize("bad_id", [-1, 100, 112])  # 112: inside the padded table (100 -> 128 rows), past the vocabulary
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_argument(bad_id):
    """Before any kernel runs: on a GPU the embedding's out-of-range read is a device-side assert
    that kills the process, and an id among the padding rows reads an untrained row silently."""
    gpt = small_gpt(vocab_size=100).eval()
    tokens = random_tokens(length=8) % 100
    tokens[1, 3] = bad_id
    message = rf"holds token id {bad_id}, outside the model's vocabulary \[0, 100\)"
    with pytest.raises(ValueError, match="idx " + message):
        gpt(tokens, targets=tokens % 100)
    with pytest.raises(ValueError, match="idx " + message):
        gpt.generate(tokens, max_new_tokens=2)
    cache = gpt.new_cache(2)
    gpt(tokens[:, :3] % 100, cache=cache)
    with pytest.raises(ValueError, match="token " + message):
        gpt.decode_step(tokens[:, 3:4], torch.tensor([3]), cache)
    assert gpt(tokens % 100, targets=tokens % 100)[1].isfinite()  # the same batch inside it runs


@pytest.mark.parametrize("bad_id", [-2, 100, 112, 128])  # 112: a padding row's logit; 128: past the padded table
def test_targets_outside_the_vocabulary_are_refused_and_minus_one_is_left_out_of_the_loss(bad_id):
    """A target among the padding ids scored against an untrained logit (a finite, wrong loss
    that trained the padding rows); one past the table, or below -1, was an IndexError (a
    device-side assert on a GPU)."""
    gpt = small_gpt(vocab_size=100)
    tokens = random_tokens(length=8) % 100
    targets = tokens.roll(-1, 1)
    targets[0, 5] = bad_id
    with pytest.raises(ValueError, match=rf"^targets holds token id {bad_id}, outside the model's vocabulary "
                                         r"\[0, 100\) \(or -1, a position left out of the loss\)"):
        gpt(tokens, targets=targets)
    targets[0, 5] = -1
    _, loss = gpt(tokens, targets=targets)
    mask = torch.ones_like(targets, dtype=torch.bool)
    mask[0, 5] = False
    logits, _ = gpt(tokens, targets=tokens)
    expected = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    torch.testing.assert_close(loss, expected)  # -1: that position alone left out


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=0.0), r"temperature=0.0: expected a finite float > 0 \(for greedy decoding pass top_k=1\)"),
    (dict(temperature=-1.0), r"temperature=-1.0: expected a finite float > 0"),
    (dict(temperature=float("nan")), r"temperature=nan: expected a finite float > 0"),
    (dict(top_k=0), r"top_k=0: expected None \(every token\) or an int >= 1"),
    (dict(top_k=2.5), r"top_k=2.5: expected None \(every token\) or an int >= 1"),
], ids=["temperature 0", "temperature < 0", "temperature nan", "top_k 0", "top_k 2.5"])
def test_generate_refuses_sampling_settings_that_draw_no_distribution(settings, message):
    # temperature=0 divided the logits into NaN, and argmax drew token 0 every time, silently;
    # top_k=0 was an IndexError inside topk.
    gpt = small_gpt().eval()
    for kv_cache in (True, False):
        with pytest.raises(ValueError, match=f"^{message}"):
            gpt.generate(random_tokens(length=3), max_new_tokens=2, kv_cache=kv_cache, **settings)


def test_generate_refuses_an_empty_prompt():
    gpt = small_gpt().eval()
    with pytest.raises(ValueError, match=r"^idx has no tokens \(shape \(2, 0\)\): generate continues a prompt of at "
                                         "least one token"):
        gpt.generate(random_tokens(length=0), max_new_tokens=2)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_head=4, n_kv_head=3), "n_kv_head=3 must divide n_head=4"),
    (dict(n_head=4, n_kv_head=8), "n_kv_head=8 must divide n_head=4"),
    (dict(n_head=4, n_kv_head=-1), "n_kv_head=-1 must divide n_head=4"),
    (dict(window=-2), "window=-2 must be -1 .no window. or an int >= 0"),
    (dict(window=2 ** 63), "window=9223372036854775808 must be -1 .no window. or an int >= 0 below 2..63"),
    (dict(n_head=3), "n_embd=32 must be divisible by n_head=3"),
])
def test_a_configuration_the_attention_cannot_run_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_gpt(**overrides)


def test_n_kv_head_defaults_to_n_head_and_the_projection_holds_the_kv_heads():
    assert GPTConfig(n_head=6).n_kv_head == 6
    assert GPTConfig().n_kv_head == GPTConfig().n_head == 12 and GPTConfig().window == -1
    assert GPTConfig(window=7).window_size == (7, 0) and GPTConfig().window_size == (-1, 0)
    # q has n_head heads, k and v n_kv_head each: (4 + 2 * 1) * 8 output features of 32 inputs.
    gpt = small_gpt(n_head=4, n_kv_head=1)
    assert gpt.transformer.h[0].attn.c_attn.weight.shape == (48, 32)


# A grouped-query (two query heads per kv head), windowed (5 keys before each query, of 32)
# model, trained from one initialisation on one batch by each backend.
def train_gqa_window_model(attn, steps=5):
    gpt = small_gpt(attn, block_size=32, vocab_size=128, n_embd=64, bias=False, **GQA_WINDOW)
    optimizer = gpt.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses, first_grads = [], None
    for _ in range(steps):
        _, loss = gpt(x, targets=y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        first_grads = first_grads or {name: p.grad.clone() for name, p in gpt.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads


@pytest.fixture(scope="module")
def gqa_window_training():
    return {attn: train_gqa_window_model(attn) for attn in BACKENDS}


@pytest.mark.xdist_group("gqa_window_training")  # the module fixture trains once, on one worker
@pytest.mark.parametrize("attn", BACKENDS)
def test_a_grouped_query_windowed_model_trains_alike_on_every_backend(gqa_window_training, attn):
    """Every backend computes the same float32 function, in another order of additions: the
    first step's gradients agree to float32 rounding (about 5e-7 of each gradient's largest
    entry measured; 2e-5 allowed), and so do the losses after five AdamW steps (about 4e-7
    relative measured; 1e-5 allowed). Adam divides each update by the gradient's own size, so a
    rounding difference does not grow by the learning rate (1e-2) over so few steps."""
    losses, grads = gqa_window_training[attn]
    eager_losses, eager_grads = gqa_window_training["eager"]
    assert losses[-1] < losses[0] - 1.0  # it learns the batch
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for name, grad in grads.items():
        scale = eager_grads[name].abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=2e-5 * scale, msg=name)
