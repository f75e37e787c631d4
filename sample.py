"""Generate text from a trained checkpoint, or time decoding.

    python sample.py --out_dir=out-shakespeare --start="ROMEO:"
    python sample.py --out_dir=out-tiny --start=FILE:data/shakespeare/prompt.txt --num_samples=3 --attn=sdpa
    python sample.py --benchmark=True --init_from=random --max_new_tokens=255 --num_samples=1

--start is the prompt, or FILE:path to read it from a file (relative to the current
directory; the repo ships data/shakespeare/prompt.txt). --attn picks the attention
backend (by default the one the checkpoint was trained with). --kv_cache=True (the default)
keeps every layer's keys and values and feeds one new token per step; --kv_cache=False
feeds the whole context every step (see GPT.generate); on a GPU the cached one-token step is a
CUDA graph, replayed per token. --compile=True compiles that step first (GPT.compile_decode_step:
one Inductor graph inside the CUDA graph; the first tokens wait for the compile). --benchmark=True prints decode
tokens/s with and without the cache instead of text. In bf16 (--dtype=auto on GPUs that have it) the
weights are cast to bf16 once and generation runs without autocast; float16 keeps them fp32 under
autocast (training/devices.py, generation_precision). Settings are the SampleConfig fields
below (see training/configurator.py; `python sample.py --help` lists them).

Exit status: 0 done; 1 an error stopped it (no usable checkpoint, an unreadable prompt file,
no such device); 2 bad configuration (unknown key, wrong type, value not allowed).
"""
import sys
import time
from dataclasses import dataclass, replace

import torch

from attention import BACKENDS
from data.shakespeare.prepare import DenseVocab, PrepareError, load_encoder
from model import GPT, GPTConfig
from training.checkpoint import CheckpointError, load_checkpoint
from training.configurator import ConfigError, choice, parse_config
from training.devices import DeviceError, generation_precision, pick_device, pick_dtype, synchronize
from training.exit_codes import EXIT_BAD_CONFIG
from training.train_config import TrainConfig, check_attn_head_dim


@dataclass
class SampleConfig:
    out_dir: str = "out-shakespeare"  # the folder holding ckpt.pt
    init_from: str = choice("checkpoint", ("checkpoint", "random"))  # random: untrained, configs/shakespeare.py's shape
    start: str = "\n"  # the prompt, or FILE:path to read it from a file, e.g. FILE:data/shakespeare/prompt.txt
    num_samples: int = 2  # samples to generate; with --benchmark=True, the batch decoded side by side
    max_new_tokens: int = 300  # tokens to generate after the prompt
    temperature: float = 0.8  # < 1 sharpens the distribution, > 1 flattens it; at least MIN_TEMPERATURE
    top_k: int = 200  # sample from the k likeliest tokens only; 0 for all
    seed: int = 1337  # seeds the sampling (and a random-init model)
    attn: str = choice("checkpoint", ("checkpoint",) + BACKENDS)  # "checkpoint": the one it trained with
    kv_cache: bool = True  # keep each layer's keys and values, feed one new token per step
    compile: bool = False  # compile the one-token decode step (needs kv_cache=True) with Inductor
    benchmark: bool = False  # print decode tokens/s with and without the KV cache (every backend unless --attn)
    device: str = choice("auto", ("auto", "cpu", "cuda"))  # auto: cuda if torch sees a GPU, else cpu
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))  # auto: bf16 or fp16 on a GPU, fp32 on the CPU; bf16 casts the weights, fp16 is autocast


# A random-init model has the shape of the GPU run (configs/shakespeare.py, train.py's
# defaults), for timing decoding without training first.
_GPU_RUN = TrainConfig()
RANDOM_MODEL = _GPU_RUN.model_config(GPTConfig.vocab_size)  # over GPT-2's own ids: no mapping to decode
# Sampling divides the logits by the temperature. Much below this, logits / temperature
# overflows (float16 logits under autocast pass 65504 once |logit| > 655 here) and the
# softmax turns NaN; and by then sampling is greedy in effect, which --top_k=1 does exactly.
MIN_TEMPERATURE = 0.01


def check_config(config):
    rules = [
        ("num_samples", config.num_samples >= 1, "an int >= 1"),
        ("max_new_tokens", config.max_new_tokens >= 1, "an int >= 1"),
        ("temperature", MIN_TEMPERATURE <= config.temperature < float("inf"),
         f"a finite float >= {MIN_TEMPERATURE} (for greedy decoding use --top_k=1)"),
        ("top_k", config.top_k >= 0, "an int >= 0 (0: no top-k)"),
        ("start", config.start not in ("", "FILE:"), "a non-empty prompt or FILE:path"),
        ("compile", config.kv_cache or not config.compile, "False when kv_cache=False (it compiles the cached step)"),
    ]
    for key, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{key}={getattr(config, key)!r}: expected {expected}")


def read_prompt(start):
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:"):]
    try:
        with open(path, encoding="utf-8") as f:
            prompt = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"start=FILE:{path}: cannot read the prompt file ({e})") from None
    if not prompt:
        raise ConfigError(f"start=FILE:{path}: the prompt file is empty")
    return prompt


def encode_prompt(encoder, prompt, vocab):
    """The prompt's token ids in the model's numbering: GPT-2's, or the dense ids of the
    corpus it trained on (vocab, from the checkpoint), where a token the corpus never used
    has no id."""
    gpt2_ids = encoder.encode(prompt, allowed_special={"<|endoftext|>"})
    if vocab is None:
        return gpt2_ids
    known = set(vocab.gpt2_ids.tolist())
    unknown = [t for t in gpt2_ids if t not in known]
    if unknown:
        raise ConfigError(f"start: the prompt's token {encoder.decode([unknown[0]])!r} (GPT-2 id {unknown[0]}) never "
                          "occurs in the text the model trained on, so it has no id for it; reword the prompt")
    return vocab.to_dense(gpt2_ids).tolist()


def decode(encoder, ids, vocab):
    return encoder.decode(ids if vocab is None else vocab.to_gpt2(ids))


def build_model(model_args, state, attn, device, dtype, out_dir, compile_decode):
    """The model ready to generate, and the context to generate under (generation_precision:
    in bf16 the weights are cast once, in fp16 they stay fp32 under autocast)."""
    model = GPT(replace(model_args, attn=attn, dropout=0.0))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        sys.exit(f"error: the weights in {out_dir}/ckpt.pt do not fit the model it describes: {e}")
    model = model.eval().to(device)
    precision = generation_precision(model, device, dtype)
    if compile_decode:
        model.compile_decode_step()
    return model, precision


def can_run(attn, model_args):
    try:
        check_attn_head_dim(attn, model_args.n_embd, model_args.n_head)
    except ConfigError:
        return False
    return True


def benchmark(config, model_args, state, prompt_ids, device, dtype):
    """Decode tokens/s of each backend with and without the KV cache. Each timed run follows
    an untimed one of the same length, in which Triton compiles and autotunes its kernels.
    Without --attn, the backends that cannot take the model's head dim are left out."""
    backends = [b for b in BACKENDS if can_run(b, model_args)] if config.attn == "checkpoint" else (config.attn,)
    batch, prompt_len = config.num_samples, prompt_ids.size(1)
    prompt_ids = prompt_ids.expand(batch, -1)
    print(f"decode: batch {batch}, {prompt_len}-token prompt, {config.max_new_tokens} new tokens, "
          f"block_size {model_args.block_size}, {device}, {dtype}" + (", compiled decode step" if config.compile else ""))
    print(f"{'attn':<12}{'no cache tok/s':>16}{'kv cache tok/s':>16}{'speedup':>9}")
    for attn in backends:
        model, precision = build_model(model_args, state, attn, device, dtype, config.out_dir, config.compile)
        tokens_per_s = []
        for kv_cache in (False, True):
            for _ in range(2):  # the first run warms up, the second is timed
                torch.manual_seed(config.seed)
                synchronize(device)
                t0 = time.perf_counter()
                with precision:
                    model.generate(prompt_ids, config.max_new_tokens, config.temperature, config.top_k or None,
                                   kv_cache=kv_cache)
                synchronize(device)
                seconds = time.perf_counter() - t0
            tokens_per_s.append(batch * config.max_new_tokens / seconds)
        print(f"{attn:<12}{tokens_per_s[0]:>16,.1f}{tokens_per_s[1]:>16,.1f}{tokens_per_s[1] / tokens_per_s[0]:>8.2f}x",
              flush=True)


def main(argv=None):
    config = parse_config(SampleConfig, argv, check=check_config, usage=__doc__)
    try:
        prompt = read_prompt(config.start)
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        ckpt = load_checkpoint(config.out_dir) if config.init_from == "checkpoint" else None
        encoder = load_encoder()
    except (ConfigError, DeviceError, CheckpointError, PrepareError) as e:
        sys.exit(f"error: {e}")

    # vocab: the dense numbering the model trained with (prepare.py); None for GPT-2's own ids
    # (a random-init model, or a checkpoint from before prepare.py remapped them).
    if ckpt is None:
        torch.manual_seed(config.seed)
        model_args, state, source, vocab = RANDOM_MODEL, GPT(RANDOM_MODEL).state_dict(), "a random-init model", None
    else:
        try:
            model_args = GPTConfig(**ckpt["model_args"])
        except TypeError as e:
            sys.exit(f"error: {config.out_dir}/ckpt.pt describes a model this code cannot build ({e})")
        state, source = ckpt["model"], f"{config.out_dir} (iter {ckpt['iter']})"
        vocab = DenseVocab(ckpt["gpt2_ids"]) if ckpt.get("gpt2_ids") is not None else None
    if config.attn != "checkpoint":
        try:
            check_attn_head_dim(config.attn, model_args.n_embd, model_args.n_head)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
    try:
        prompt_ids = torch.tensor([encode_prompt(encoder, prompt, vocab)], device=device)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if config.benchmark:
        print(f"timing decoding with {source}", file=sys.stderr)
        benchmark(config, model_args, state, prompt_ids, device, dtype)
        return

    attn = model_args.attn if config.attn == "checkpoint" else config.attn
    model, precision = build_model(model_args, state, attn, device, dtype, config.out_dir, config.compile)
    print(f"sampling from {source} with attn={attn}, kv_cache={config.kv_cache}, compile={config.compile} on {device}",
          file=sys.stderr)
    torch.manual_seed(config.seed)
    for _ in range(config.num_samples):
        with precision:
            ids = model.generate(prompt_ids, config.max_new_tokens, config.temperature, config.top_k or None,
                                 kv_cache=config.kv_cache)
        print(decode(encoder, ids[0].tolist(), vocab))
        print("---------------")


if __name__ == "__main__":
    main()
