"""A GPT-2 style language model whose attention runs on a chosen backend.

Pre-LayerNorm blocks, a GELU MLP, learned positions and an output layer tied to the token
embedding, initialised as GPT-2 was. CausalSelfAttention hands the q, k, v views of its fused
projection to `attention.attention` (to `attention.decode_attention` for a decoding step), so
the same model trains and generates on every backend. Two keys go beyond GPT-2, both off by
default: n_kv_head (grouped-query attention, as Llama and Mistral have) and window (a sliding
window over the keys, as Mistral and the speedrun GPTs use).

Generation keeps a KVCache, every layer's keys and values so far: the prompt goes in as one
call (a prefill), then each token is one GPT.decode_step, run by a StaticDecoder whose inputs
are static device buffers the step itself updates, sampling included, so on CUDA it is captured
once as a CUDA graph and a token is one replay (compiled with sample.py --compile=True)."""
import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import BACKENDS, attention, decode_attention, store_in_cache
from attention.decode import check_position
from attention.cuda_graph import capture_graph

# torch.profiler ranges that training/profiling.py sorts a step's time by.
ATTENTION_RANGE = "attention"
OUTPUT_RANGE = "output layer + loss"


def labelled(name):
    """A torch.profiler range named `name` while a profiler records; nothing otherwise (a
    range costs a few microseconds even with no profiler, and a small model's step is
    launch-bound). Nothing under torch.compile either: asking whether the profiler is on
    would break the graph there, and compiled code drops ranges anyway."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


@dataclass
class GPTConfig:
    """The defaults are the default run's (train.py with no arguments; training/config.py says
    why each value)."""
    block_size: int = 512
    vocab_size: int = 11706  # the GPT-2 tokens TinyShakespeare uses, renumbered densely (data/shakespeare/prepare.py)
    n_layer: int = 8
    n_head: int = 12
    n_kv_head: int = 0  # key/value heads, a divisor of n_head; 0: n_head (multi-head attention)
    n_embd: int = 384
    window: int = -1  # each query sees itself and the `window` keys before it; -1: every key before it
    dropout: float = 0.35
    bias: bool = False  # biases in Linear layers and LayerNorms (GPT-2 has them)
    attn: str = "eager"

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def window_size(self):
        """attention's (left, right): causal, and left = window."""
        return (self.window, 0)

    @property
    def padded_vocab_size(self):
        # A multiple of 64 (11706 -> 11712, GPT-2's 50257 -> 50304): output-layer matmuls tile evenly on GPUs.
        return math.ceil(self.vocab_size / 64) * 64


def check_token_ids(name, ids, vocab_size, lowest=0):
    """A ValueError naming ids when one lies outside [lowest, vocab_size): the embedding (or the
    loss, for targets, where lowest=-1 is the position the loss leaves out) would read outside
    its table, on the CPU an IndexError, on a GPU a device-side assert that kills the process
    with no word on which input was wrong; a target among the padding ids would score silently
    against an untrained logit. Reading the ids' range is a host sync, which
    torch.compile cannot trace and a CUDA graph capture refuses: inside those the check is left
    out (the compiled or captured step reads the ids its caller checked or drew itself, as
    StaticDecoder's draws are)."""
    if torch.compiler.is_compiling() or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < lowest or high >= vocab_size:
        raise ValueError(f"{name} holds token id {low if low < lowest else high}, outside the model's vocabulary "
                         f"[0, {vocab_size})" + (" (or -1, a position left out of the loss)" if lowest == -1 else ""))


class KVCache:
    """Every layer's keys and values: layers[i] is layer i's (k, v), two static
    (B, n_kv_head, block_size, D) buffers (grouped-query attention keeps n_head / n_kv_head
    times fewer bytes), of which positions [0, length) are filled. Allocated whole and zeroed,
    they never grow or move, so a compiled or captured decode step sees the same tensors at
    every step; a tensor per layer, because a compiled write into a view of one big tensor is
    made into a copy of it. length is the host's count of the tokens stored."""

    def __init__(self, n_layer, batch_size, n_head, block_size, head_dim, dtype, device):
        shape = (batch_size, n_head, block_size, head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(n_layer)]
        self.batch_size, self.block_size, self.dtype, self.device = batch_size, block_size, dtype, self.layers[0][0].device
        self.length = 0


def sample_next_token(logits, vocab_size, temperature=1.0, top_k=None):
    """The next token (B, 1) drawn from the last position's logits (B, padded vocab), on every
    decoding path; padding ids past vocab_size never. It never asks the host for a value, so a
    CUDA graph can capture it: an exponential race, argmax(p / E) with E ~ Exp(1) per token,
    picks token i with probability p_i (the Gumbel-max trick, as gpt-fast samples), E kept above
    0 so a token of probability 0 never wins. top_k=1 is the argmax itself."""
    if top_k == 1:
        return torch.argmax(logits[:, :vocab_size], dim=-1, keepdim=True)
    logits = logits[:, :vocab_size].float() / temperature
    if top_k is not None:
        # The k-th largest logit (a slice: a list index would copy from the host).
        kth = torch.topk(logits, min(top_k, vocab_size)).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_(1).clamp_min_(torch.finfo(probs.dtype).tiny)
    return torch.argmax(probs / race, dim=-1, keepdim=True)


class StaticDecoder:
    """generate's decoding loop after a prefill: per token, GPT.decode_step over a static
    KVCache and sample_next_token, with fixed sampling settings. Its state lives in static
    device buffers: token (B, 1) to feed, pos (1,) its position, drawn (B, block_size) the
    tokens drawn. One step feeds token at pos, draws the next into token and drawn, and
    advances pos, all on the device: every input has one shape, stride and address for the
    decoder's life, so torch.compile compiles the step once and on CUDA it is captured once
    into a torch.cuda.CUDAGraph, a token one replay. On the CPU the step runs as is."""

    def __init__(self, step, cache, vocab_size, temperature, top_k):
        self.decode_step = step
        self.cache = cache
        self.sampling = dict(vocab_size=vocab_size, temperature=temperature, top_k=top_k)
        batch, device = cache.batch_size, cache.device
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.drawn = torch.zeros(batch, cache.block_size, dtype=torch.long, device=device)
        self.graphed = device.type == "cuda"  # captured at the first decode, then replayed
        self.graph = None

    def step(self):
        logits = self.decode_step(self.token, self.pos, self.cache)
        next_token = sample_next_token(logits[:, -1, :], **self.sampling)
        self.drawn.index_copy_(1, self.pos, next_token)
        self.token.copy_(next_token)
        self.pos.add_(1)

    def decode(self, token, n_tokens):
        """The n_tokens tokens (B, n_tokens) drawn after feeding token (B, 1) at position
        cache.length, each fed in turn; their keys and values go into the cache."""
        start = self.cache.length
        if start + n_tokens > self.drawn.shape[1]:
            raise ValueError(f"{n_tokens} tokens after {start} cached exceed block_size={self.drawn.shape[1]}")
        self.token.copy_(token)
        self.pos.fill_(start)  # the value goes in as a kernel argument: no host-to-device copy
        if self.graphed and self.graph is None:
            self.capture()
        for _ in range(n_tokens):
            if self.graph is None:
                self.step()
            else:
                self.graph.replay()
        self.cache.length = start + n_tokens
        return self.drawn[:, start:start + n_tokens].clone()

    def capture(self):
        """Record one step (attention.cuda_graph.capture_graph) after two warm-up steps
        (compiling and Triton's loading may not happen during capture). Each warm-up step starts
        from the saved token and pos, and draws on a forked RNG, so the replays write and draw what
        uncaptured steps would. Autocast's cache of cast weights would be freed under a graph that
        still reads it, so bf16 generation casts the weights once beforehand (training/devices.py's
        generation_precision) and only float16's keeps autocast, uncached."""
        autocast = dict(device_type="cuda", dtype=torch.get_autocast_dtype("cuda"),
                        enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        token, pos = self.token.clone(), self.pos.clone()

        def restart():
            self.token.copy_(token)
            self.pos.copy_(pos)

        def warm_up():
            with torch.random.fork_rng(devices=[self.token.device]):
                for _ in range(2):
                    restart()
                    self.step()
            restart()

        with torch.autocast(**autocast):
            self.graph, _ = capture_graph(self.step, warm_up)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.window_size = config.window_size
        self.attn_backend = config.attn
        # One matmul projects q (n_head heads), k and v (n_kv_head heads each).
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # Only the residual output gets dropout: the fused backends never materialise the
        # attention probabilities, so there is nothing to drop inside attention itself.
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, pos=None):
        """kv_cache: this layer's (k, v) cache buffers, (B, n_kv_head, block_size, D) each; pos
        (T,): the positions of x's tokens, a device tensor, where their keys and values are stored."""
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
        # (B, heads, T, D) views of the projection: the kernels read them through their strides.
        q, k, v = qkv.transpose(1, 2).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=1)
        if kv_cache is not None and T == 1:
            # One new token (a decode step, or a one-token prompt): decode_attention stores its
            # key and value at pos and lets its query see the cached keys up to its own, all in
            # its past, so nothing else is masked.
            y = decode_attention(q, k, v, *kv_cache, pos, self.window_size, backend=self.attn_backend)
        else:
            if kv_cache is not None:
                # A prefill into an empty cache: store the prompt's keys and values, then attend
                # as training does, over the same T tokens, top-left causal, so its logits are
                # exactly those of the same tokens fed without a cache.
                store_in_cache(k, v, *kv_cache, pos)
            with labelled(ATTENTION_RANGE):
                y = attention(q, k, v, is_causal=True, backend=self.attn_backend, window_size=self.window_size)
        # (B, H, T, D) laid out (B, T, H, D) (every backend keeps q's memory order) -> (B, T, C): no copy
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, pos=None):
        x = x + self.attn(self.ln_1(x), kv_cache, pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.attn not in BACKENDS:
            raise ValueError(f"attn={config.attn!r} is not one of {BACKENDS}")
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        if config.n_kv_head < 1 or config.n_head % config.n_kv_head != 0:
            raise ValueError(f"n_kv_head={config.n_kv_head} must divide n_head={config.n_head}")
        if not -1 <= config.window < 2 ** 63:  # attention's window sides are int64
            raise ValueError(f"window={config.window} must be -1 (no window) or an int >= 0 below 2**63")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.generate_decoder = None  # generate's StaticDecoder and its cache, kept between calls
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings

        self.apply(self._init_weights)
        # GPT-2 scales the layers that write into the residual stream by 1/sqrt(2 * n_layer),
        # so the stream's variance does not grow with depth (two such writes per block).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count; the position table is left out by default, as it does no matmul.
        (The token table is counted: tied to lm_head, it does the output matmul.)"""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def new_cache(self, batch_size, dtype=None, device=None):
        """An empty KVCache for batch_size sequences, for forward(idx, cache=...) and decode_step.
        dtype: that of the keys it will hold (autocast's, under autocast); by default the
        weights'. device: by default the weights'."""
        cfg, weight = self.config, self.lm_head.weight
        return KVCache(cfg.n_layer, batch_size, cfg.n_kv_head, cfg.block_size, cfg.head_dim,
                       dtype or weight.dtype, device or weight.device)

    def forward(self, idx, targets=None, cache=None):
        """Logits for every position and the mean cross-entropy when targets are given (the
        logits then detached: a compiled backward would fill them a zero gradient); without
        targets, only the last position's logits. cache (from new_cache()): idx continues the
        tokens already in it and its keys and values are stored; an empty cache takes any
        number of tokens (a prefill), a filled one one token at a time."""
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start > 0 and T != 1:
            raise ValueError(f"idx has {T} tokens but the cache already holds {start}: after the prefill, feed "
                             "one token at a time (attention's top-left causal mask cannot place several new "
                             "queries after cached keys)")
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} ({start} cached + {T} new) exceeds "
                             f"block_size={self.config.block_size}")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"idx has batch {B} but the cache was made for batch {cache.batch_size}")
        check_token_ids("idx", idx, self.config.vocab_size)
        if targets is not None:
            check_token_ids("targets", targets, self.config.vocab_size, lowest=-1)
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.hidden_states(idx, pos, cache)
        if cache is not None:
            cache.length = start + T
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        with labelled(OUTPUT_RANGE):
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits.detach(), loss

    def hidden_states(self, idx, pos, cache=None):
        """The final LayerNorm's output (B, T, n_embd) for tokens idx at positions pos (T,)."""
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if cache is None else cache.layers[i], pos)
        return self.transformer.ln_f(x)

    def decode_step(self, token, pos, cache):
        """Logits (B, 1, vocab) for token (B, 1) at position pos, a (1,) integer tensor on the
        device; its keys and values go into cache at pos (the caller keeps cache.length).
        Compiled or captured, nothing here asks the host for a value (the token's check is left
        out there), and every tensor has the same shape at every step: this is what
        compile_decode_step compiles and CUDA graphs replay."""
        check_token_ids("token", token, self.config.vocab_size)
        check_position(pos, token.device, cache.block_size)  # before the position embedding reads it
        return self.lm_head(self.hidden_states(token, pos, cache))

    def compile_decode_step(self, backend="inductor"):
        """Replace decode_step with one torch.compile graph (fullgraph, dynamic=False: a new
        batch size compiles a static graph of its own). StaticDecoder captures it in its own
        CUDA graph, so Inductor's mode stays the default; sampling stays outside it, so one seed
        draws the same tokens compiled or not. Coordinate descent tuning is on, as gpt-fast
        decodes: it has Inductor write a one-row matmul as a reduction fused with the layer norm
        and the GELU or residual add around it, where cuBLAS runs each matmul alone."""
        options = {"coordinate_descent_tuning": True} if backend == "inductor" else None
        self.decode_step = torch.compile(self.decode_step, backend=backend, fullgraph=True, dynamic=False,
                                         options=options)
        self.generate_decoder = None  # its graph recorded the uncompiled step

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay only on matrices (matmul weights and embeddings), not on
        biases and LayerNorm gains, which set scale and offset rather than store features."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # The fused CUDA kernel updates all parameters in a few launches instead of many.
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    def flops_per_token(self):
        """Training FLOPs (forward + backward) per token, as in the PaLM paper's appendix B:
        6 per parameter for the matmuls, plus 12 * n_layer * n_embd * block_size for the
        attention scores and their product with V (counted in full, though causal masking
        lets a kernel skip about half)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def reusable_decoder(self, batch_size, device, temperature, top_k):
        """generate's StaticDecoder: the one of its last call when it fits (batch, dtype, device
        and sampling settings), so that its cache, buffers and CUDA graph are reused, not
        allocated and recorded again at every generate; other sampling settings mean another
        graph. The cache's dtype is that of the keys: autocast's under autocast, else the weights'."""
        device_type = device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.lm_head.weight.dtype
        sampling = dict(vocab_size=self.config.vocab_size, temperature=temperature, top_k=top_k)
        decoder = self.generate_decoder
        if decoder is None or decoder.cache.batch_size != batch_size or decoder.cache.dtype != dtype \
                or decoder.cache.device != device or decoder.sampling != sampling:
            decoder = self.generate_decoder = StaticDecoder(self.decode_step, self.new_cache(batch_size, dtype, device),
                                                            **sampling)
        return decoder

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, kv_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T), the model seeing at most the last
        block_size tokens. kv_cache=True prefills a cache with the context, then a StaticDecoder
        feeds each drawn token back, on the device, until the cache holds block_size tokens;
        from then on it is refilled from the last block_size tokens every step (learned
        positions move every cached key). kv_cache=False feeds the whole context every step.
        Both show the model the same tokens at the same positions, so greedy decoding gives the
        same tokens either way."""
        if idx.size(1) == 0:
            raise ValueError(f"idx has no tokens (shape {tuple(idx.shape)}): generate continues a prompt of at least "
                             "one token")
        if not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
            raise ValueError(f"temperature={temperature!r}: expected a finite float > 0 (for greedy decoding pass "
                             "top_k=1)")
        if top_k is not None and not (type(top_k) is int and top_k >= 1):
            raise ValueError(f"top_k={top_k!r}: expected None (every token) or an int >= 1")
        block_size, vocab_size = self.config.block_size, self.config.vocab_size
        decoder = self.reusable_decoder(idx.size(0), idx.device, temperature, top_k) if kv_cache else None
        new_tokens = 0
        while new_tokens < max_new_tokens:
            if decoder is None or new_tokens == 0 or decoder.cache.length == block_size:
                if decoder is not None:
                    decoder.cache.length = 0  # the same buffers, refilled: the decoder keeps its graph
                logits, _ = self(idx[:, -block_size:], cache=None if decoder is None else decoder.cache)
                drawn = sample_next_token(logits[:, -1, :], vocab_size, temperature, top_k)
            else:
                drawn = decoder.decode(idx[:, -1:], min(max_new_tokens - new_tokens, block_size - decoder.cache.length))
            idx = torch.cat((idx, drawn), dim=1)
            new_tokens += drawn.size(1)
        return idx


# Inductor options on top of the mode's: combo kernels launch independent small kernels as one
# (a step's many little casts and elementwise kernels), which measured 4% less GPU time per
# compiled training step on the H200.
INDUCTOR_OPTIONS = {"combo_kernels": True}


def compile_model(model, mode):
    """torch.compile(model, mode=mode) with INDUCTOR_OPTIONS. With the modes that capture
    CUDA graphs (reduce-overhead, max-autotune) a parameter's gradient can live in the graph's
    memory, which the next micro-batch's replay overwrites while autograd still holds it, so
    accumulated gradients could be silently wrong (pytorch/pytorch#96693): a hook hands autograd
    a copy. train.py marks each step's start (cudagraph_mark_step_begin) for the same reason."""
    if mode in ("reduce-overhead", "max-autotune"):
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(torch.clone)
    return torch.compile(model, options={**torch._inductor.list_mode_options(mode), **INDUCTOR_OPTIONS})
