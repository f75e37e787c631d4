"""Generate text from a trained checkpoint, or time decoding.

    python sample.py --out_dir=out-shakespeare --start="ROMEO:"
    python sample.py --out_dir=out-tiny --start=FILE:data/shakespeare/prompt.txt --num_samples=3 --attn=sdpa
    python sample.py --benchmark=True --init_from=random --max_new_tokens=255 --num_samples=1

--start is the prompt, or FILE:path to read it from (relative to the current directory). A model
trained here knows only its text's GPT-2 tokens, never <|endoftext|>: a prompt with a token it
never saw is refused, naming it. --kv_cache=True feeds one new token a step, on a GPU from a CUDA
graph (--compile=True compiles that step). --benchmark=True prints decode tokens/s with and
without the cache per backend (on the CPU not the Triton ones, unless --attn names one); for a
model with fewer kv heads than query heads, also for one with a kv head per query head (G = 1).

Exit status: 0 done; 1 an error stopped it (no usable checkpoint); 2 bad configuration: a
setting wrong in itself or one that cannot run here (no GPU for --device=cuda, an unreadable
prompt file, a prompt the model has no tokens for, a head dim the backend cannot take).
"""
import contextlib
import sys
import time
from dataclasses import replace

from training.config import (BACKENDS, TRITON_BACKENDS, ConfigError, SampleConfig, check_attn_head_dim,
                             check_sample_config, exit_bad_config, parse_config)

# Parsed before torch loads (1.5 s or more), so that --help and a bad setting answer at once.
config = parse_config(SampleConfig, check=check_sample_config, usage=__doc__)

import torch

from data.shakespeare.prepare import DenseVocab, PrepareError, load_encoder
from model import GPT, GPTConfig
from training.devices import choose_cpu_threads, generation_precision, pick_device, pick_dtype, synchronize
from training.run_files import RunFileError, load_checkpoint

END_OF_TEXT = "<|endoftext|>"


def read_prompt(start):
    path = start.removeprefix("FILE:")
    if path == start:
        return start
    try:
        with open(path, encoding="utf-8") as f:
            prompt = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"start=FILE:{path}: cannot read the prompt file ({e})") from None
    if not prompt:
        raise ConfigError(f"start=FILE:{path}: the prompt file is empty")
    return prompt


def encode_prompt(encoder, prompt, vocab):
    """The prompt's token ids in the model's numbering: GPT-2's, or its corpus's dense ids (vocab)."""
    gpt2_ids = encoder.encode(prompt, allowed_special={END_OF_TEXT})
    if vocab is None:
        return gpt2_ids
    known = set(vocab.gpt2_ids.tolist())
    unknown = [t for t in gpt2_ids if t not in known]
    if unknown and encoder.decode([unknown[0]]) == END_OF_TEXT:
        raise ConfigError(f"start: {END_OF_TEXT} is GPT-2's end-of-text token, which the text the model trained on "
                          "never holds (prepare.py encodes the text alone), so the model has no id for it; "
                          "leave it out of the prompt")
    if unknown:
        raise ConfigError(f"start: the prompt's token {encoder.decode([unknown[0]])!r} (GPT-2 id {unknown[0]}) never "
                          "occurs in the text the model trained on, so it has no id for it; reword the prompt")
    return vocab.to_dense(gpt2_ids).tolist()


def build_model(model_args, state, attn, device, dtype, compile_decode):
    """The model ready to generate, and the context to generate under (generation_precision)."""
    model = GPT(replace(model_args, attn=attn, dropout=0.0))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise RunFileError(f"the weights in {config.out_dir}/ckpt.pt do not fit the model it describes: {e}") from None
    model = model.eval().to(device)
    precision = generation_precision(model, device, dtype)
    if compile_decode:
        model.compile_decode_step()
    return model, precision


def can_run(attn, model_args):
    with contextlib.suppress(ConfigError):
        return check_attn_head_dim(attn, model_args.n_embd, model_args.n_head) is None
    return False


def benchmark(model_args, state, prompt_ids, device, dtype):
    """Decode tokens/s of each backend with and without the KV cache, and where the model has
    grouped-query heads (G query heads a kv head), of the same shape with G = 1 (random weights:
    the time does not depend on them). On a GPU an untimed run of the same length goes first: it
    compiles, tunes (once a power-of-two bucket of the context length, launch.length_bucket) and
    makes each length's launch plan; on the CPU a few tokens."""
    backends = [b for b in BACKENDS if can_run(b, model_args) and (device.type == "cuda" or b not in TRITON_BACKENDS)]
    backends = backends if config.attn == "checkpoint" else [config.attn]
    models = [(model_args, state)]
    if model_args.n_kv_head != model_args.n_head:
        torch.manual_seed(config.seed)
        one_per_head = replace(model_args, n_kv_head=model_args.n_head)
        models.append((one_per_head, GPT(one_per_head).state_dict()))
    batch, prompt_len = config.num_samples, prompt_ids.size(1)
    prompt_ids = prompt_ids.expand(batch, -1)
    warmup_tokens = config.max_new_tokens if device.type == "cuda" else min(8, config.max_new_tokens)
    print(f"decode: batch {batch}, {prompt_len}-token prompt, {config.max_new_tokens} new tokens, "
          f"block_size {model_args.block_size}, {model_args.n_head} query heads, {device}, {dtype}"
          + (", compiled decode step" if config.compile else ""))
    print(f"{'attn':<12}{'kv heads':>14}{'no cache tok/s':>16}{'kv cache tok/s':>16}{'speedup':>9}")
    for attn, (args, weights) in ((attn, m) for attn in backends for m in models):
        model, precision = build_model(args, weights, attn, device, dtype, config.compile)
        tokens_per_s = []
        for kv_cache in (False, True):
            for new_tokens in (warmup_tokens, config.max_new_tokens):  # the first run warms up, the second is timed
                torch.manual_seed(config.seed)
                synchronize(device)
                t0 = time.perf_counter()
                with precision:
                    model.generate(prompt_ids, new_tokens, config.temperature, config.top_k or None, kv_cache=kv_cache)
                synchronize(device)
                seconds = time.perf_counter() - t0
            tokens_per_s.append(batch * config.max_new_tokens / seconds)
        kv_heads = f"{args.n_kv_head} (G = {args.n_head // args.n_kv_head})"
        print(f"{attn:<12}{kv_heads:>14}{tokens_per_s[0]:>16,.1f}{tokens_per_s[1]:>16,.1f}"
              f"{tokens_per_s[1] / tokens_per_s[0]:>8.2f}x", flush=True)


def load_model_args():
    """(model_args, weights, what they are, vocab): vocab is the dense numbering the model
    trained with, or None for GPT-2's own ids (a random-init model)."""
    if config.init_from == "random":
        torch.manual_seed(config.seed)
        model_args = GPTConfig(n_kv_head=config.n_kv_head, window=config.window)  # the default run's model
        return model_args, GPT(model_args).state_dict(), "a random-init model", None
    ckpt = load_checkpoint(f"{config.out_dir}/ckpt.pt")
    vocab = DenseVocab(ckpt["gpt2_ids"]) if ckpt.get("gpt2_ids") is not None else None
    return GPTConfig(**ckpt["model_args"]), ckpt["model"], f"{config.out_dir} (iter {ckpt['iter']})", vocab


def main():
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    prompt = read_prompt(config.start)
    model_args, state, source, vocab = load_model_args()
    encoder = load_encoder()
    if config.attn != "checkpoint":
        check_attn_head_dim(config.attn, model_args.n_embd, model_args.n_head)
    prompt_ids = torch.tensor([encode_prompt(encoder, prompt, vocab)], device=device)
    if device.type == "cpu":  # a decoded token costs about a multiply-add per weight
        print(choose_cpu_threads(2 * sum(t.numel() for t in state.values()) * config.num_samples), file=sys.stderr)
    if config.benchmark:
        print(f"timing decoding with {source}", file=sys.stderr)
        benchmark(model_args, state, prompt_ids, device, dtype)
        return
    attn = model_args.attn if config.attn == "checkpoint" else config.attn
    model, precision = build_model(model_args, state, attn, device, dtype, config.compile)
    print(f"sampling from {source} with attn={attn}, kv_cache={config.kv_cache}, compile={config.compile} on {device}",
          file=sys.stderr)
    torch.manual_seed(config.seed)
    for sample in range(config.num_samples):
        t0 = time.perf_counter()
        with precision:
            ids = model.generate(prompt_ids, config.max_new_tokens, config.temperature, config.top_k or None,
                                 kv_cache=config.kv_cache)
        seconds = time.perf_counter() - t0
        print(f"sample {sample + 1}/{config.num_samples}: {config.max_new_tokens} tokens in {seconds:.1f} s "
              f"({config.max_new_tokens / seconds:,.0f} tok/s)", file=sys.stderr)
        print(encoder.decode(ids[0].tolist() if vocab is None else vocab.to_gpt2(ids[0].tolist())))
        print("---------------")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        exit_bad_config(e)
    except (RunFileError, PrepareError) as e:
        sys.exit(f"error: {e}")
