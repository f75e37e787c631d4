"""Generate text from a trained checkpoint.

    python sample.py --out_dir=out-shakespeare --start="ROMEO:"
    python sample.py --out_dir=out-tiny --start=FILE:prompt.txt --num_samples=3 --attn=sdpa

--start is the prompt, or FILE:path to read it from a file. --attn picks the attention
backend (by default the one the checkpoint was trained with). Settings are the
SampleConfig fields below (see configurator.py; `python sample.py --help` lists them).
"""
import sys
from dataclasses import dataclass

import tiktoken
import torch

from attention import BACKENDS
from checkpoint import CheckpointError, load_checkpoint
from configurator import ConfigError, choice, parse_config
from devices import DeviceError, autocast, pick_device, pick_dtype
from model import GPT, GPTConfig


@dataclass
class SampleConfig:
    out_dir: str = "out-shakespeare"  # the folder holding ckpt.pt
    start: str = "\n"  # the prompt, or FILE:path
    num_samples: int = 2
    max_new_tokens: int = 300
    temperature: float = 0.8  # < 1 sharpens the distribution, > 1 flattens it
    top_k: int = 200  # sample from the k likeliest tokens only; 0 for all
    seed: int = 1337
    attn: str = choice("checkpoint", ("checkpoint",) + BACKENDS)  # "checkpoint": the one it trained with
    device: str = choice("auto", ("auto", "cpu", "cuda"))
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))


def check_config(config):
    rules = [
        ("num_samples", config.num_samples >= 1, "an int >= 1"),
        ("max_new_tokens", config.max_new_tokens >= 1, "an int >= 1"),
        ("temperature", 0.0 < config.temperature < float("inf"), "a finite float > 0"),
        ("top_k", config.top_k >= 0, "an int >= 0 (0: no top-k)"),
        ("start", config.start not in ("", "FILE:"), "a non-empty prompt or FILE:path"),
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


def main(argv=None):
    config = parse_config(SampleConfig, argv, check=check_config)
    try:
        prompt = read_prompt(config.start)
        device = pick_device(config.device)
        amp = autocast(device, pick_dtype(config.dtype, device))
        ckpt = load_checkpoint(config.out_dir)
    except (ConfigError, DeviceError, CheckpointError) as e:
        sys.exit(f"error: {e}")

    model_args = GPTConfig(**ckpt["model_args"])
    if config.attn != "checkpoint":
        model_args.attn = config.attn
    model_args.dropout = 0.0
    model = GPT(model_args)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        sys.exit(f"error: the weights in {config.out_dir}/ckpt.pt do not fit the model it describes: {e}")
    model.eval().to(device)
    print(f"sampling from {config.out_dir} (iter {ckpt['iter']}) with attn={model_args.attn} on {device}",
          file=sys.stderr)

    encoder = tiktoken.get_encoding("gpt2")
    prompt_ids = torch.tensor([encoder.encode(prompt, allowed_special={"<|endoftext|>"})], device=device)
    torch.manual_seed(config.seed)
    for _ in range(config.num_samples):
        with amp:
            ids = model.generate(prompt_ids, config.max_new_tokens, config.temperature, config.top_k or None)
        print(encoder.decode(ids[0].tolist()))
        print("---------------")


if __name__ == "__main__":
    main()
