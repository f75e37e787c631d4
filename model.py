"""A GPT-2 style language model whose attention runs on a chosen backend.

Pre-LayerNorm transformer blocks, a GELU MLP, learned position embeddings and an output
layer tied to the token embedding, initialised as GPT-2 was. The only departure from a
textbook GPT is that CausalSelfAttention hands its fused q, k, v projection to
`attention.packed_attention` (q, k and v to `attention.attention` when it keeps a KV cache), so
the same model trains with the eager reference, PyTorch's sdpa, or this repo's own kernels.

Generation can keep a KVCache: every layer's keys and values of the tokens fed so far, so
each step feeds only the newest token. Causal convention: the attention package masks
top-left (key j visible to query i when j <= i), which is right when queries and keys are
the same tokens (training, and a prompt's prefill into an empty cache: is_causal=True).
A lone new token against the cache is the last of the sequence, so every cached key is in
its past: it calls attention with is_causal=False (top-left causal would show it key 0 only).
"""
import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import BACKENDS, attention, packed_attention

# torch.profiler ranges that profiling.py sorts a step's time by.
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
    block_size: int = 256
    vocab_size: int = 50257  # GPT-2's tokenizer; the embedding is padded (see padded_vocab_size)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2 has
    attn: str = "eager"

    @property
    def padded_vocab_size(self):
        # 50257 -> 50304, a multiple of 64: matmuls on the output layer tile evenly on GPUs.
        return math.ceil(self.vocab_size / 64) * 64


class KVCache:
    """One layer's keys and values for the tokens fed so far: (B, H, block_size, D) buffers
    of which positions [0, length) are filled. They are allocated at the first append, in the
    dtype of the keys (autocast's, under autocast), and never grow: a model with learned
    positions cannot see past block_size anyway (see GPT.generate for what happens there)."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.k = self.v = None
        self.length = 0

    def append(self, k, v):
        """Store k, v (B, H, T, D) at positions [length, length + T); return views of all the
        keys and values stored so far."""
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, self.block_size, D)
            self.v = v.new_empty(B, H, self.block_size, D)
        end = self.length + k.size(2)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.attn_backend = config.attn
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # Only the residual output gets dropout: the fused backends never materialise the
        # attention probabilities, so there is nothing to drop inside attention itself.
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        head_dim = C // self.n_head
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, head_dim)
        if cache is None:
            # Training: the fused projection goes to attention whole (q, k, v = qkv.unbind(2)),
            # which spares the triton backend six autograd nodes a layer (attention/__init__.py).
            with labelled(ATTENTION_RANGE):
                y = packed_attention(qkv, is_causal=True, backend=self.attn_backend)
        else:
            # q, k, v are strided (B, H, T, D) views into the fused projection, not copies: the
            # backends are expected to cope with that layout (last dim contiguous).
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
            if cache.length == 0:
                # A prefill: queries and keys are the same T tokens, top-left causal. It attends
                # over its own k, v rather than the cache's copies, so its logits are exactly
                # those of the same tokens fed without a cache.
                cache.append(k, v)
                y = attention(q, k, v, is_causal=True, backend=self.attn_backend)
            else:
                # One new token (GPT.forward allows no more) against every cached key: all are
                # in its past, so nothing is masked.
                k, v = cache.append(k, v)
                y = attention(q, k, v, is_causal=False, backend=self.attn_backend)
            y = y.transpose(1, 2)
        y = y.reshape(B, T, C)  # (B, T, H, D) -> (B, T, H * D): free when y is contiguous
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

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.attn not in BACKENDS:
            raise ValueError(f"attn={config.attn!r} is not one of {BACKENDS}")
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
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

    def new_cache(self):
        """An empty KV cache for forward(idx, cache=...): one KVCache per layer."""
        return [KVCache(self.config.block_size) for _ in self.transformer.h]

    def forward(self, idx, targets=None, cache=None):
        """Logits for every position and the mean cross-entropy when targets are given;
        without targets, only the last position's logits (all that generation needs).

        cache (from new_cache()): idx continues the tokens already in it, at the positions
        after them, and its keys and values are appended. An empty cache takes any number of
        tokens (a prefill); a filled one takes one token at a time."""
        B, T = idx.shape
        start = 0 if cache is None else cache[0].length
        if start > 0 and T != 1:
            raise ValueError(f"idx has {T} tokens but the cache already holds {start}: after the prefill, feed "
                             "one token at a time (attention's top-left causal mask cannot place several new "
                             "queries after cached keys)")
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} ({start} cached + {T} new) exceeds "
                             f"block_size={self.config.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if cache is None else cache[i])
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        with labelled(OUTPUT_RANGE):
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, kv_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T), the model seeing at most the last
        block_size tokens each step. Padding ids past the real vocabulary are never drawn.

        kv_cache=False feeds the whole context every step. kv_cache=True prefills a cache
        with the context once, then feeds only the newest token. Once the cache holds
        block_size tokens it is rebuilt from the last block_size tokens at every step: the
        context window slides by one, every token's position changes, and with learned
        positions so do all the cached keys and values. Past block_size the cache saves
        nothing, but both loops show the model the same tokens at the same positions, so
        greedy decoding (top_k=1) gives the same tokens with and without the cache."""
        block_size = self.config.block_size
        cache = None
        for _ in range(max_new_tokens):
            if not kv_cache:
                logits, _ = self(idx[:, -block_size:])
            elif cache is None or cache[0].length == block_size:
                cache = self.new_cache()
                logits, _ = self(idx[:, -block_size:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :] / temperature
            logits[:, self.config.vocab_size:] = float("-inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = float("-inf")
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx
