"""The scripts' settings: a dataclass of typed defaults, then config files (Python whose top-level
assignments set keys), then --key=value or --key value. Every value is checked against its
field's type and `choice`s, so a typo stops the script in one line (exit status 2); --help lists
each key with its default and meaning (the comment ending its line). No torch here, so --help
and a bad setting answer at once. Also the exit statuses, a run's file names and the checks.

    config = parse_config(TrainConfig, check=check_config, usage=__doc__)   # reads sys.argv[1:]
"""
import dataclasses
import difflib
import inspect
import math
import os
import re
import runpy
import sys
import types
import typing
from dataclasses import dataclass

from data.files import folder_lock
from data.shakespeare.prepare import DEFAULT_OUT_DIR as DEFAULT_DATA_DIR

EXIT_ERROR = 1  # an error stopped the script: bad data, an unusable checkpoint, a failed write, a NaN loss
EXIT_BAD_CONFIG = 2  # bad configuration: a setting wrong in itself, or one this machine or data cannot run
EXIT_OUT_OF_MEMORY = 3  # the device ran out of memory

# What a run keeps in its out_dir (training/run_files.py writes them).
CHECKPOINT_NAME = "ckpt.pt"  # the best checkpoint (every evaluation's with always_save_checkpoint): what sample.py reads
RESUME_NAME = "resume.pt"  # where a stopped run continues, when that is not ckpt.pt
METRICS_NAME = "metrics.jsonl"
CONFIG_NAME = "config.json"
# The backends' table read as a file: importing attention.backends would run attention/__init__.py
# first, and with it torch, which --help and a bad setting answer before.
_backends = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "attention",
                                        "backends.py"))
BACKENDS, TRITON_BACKENDS = _backends["BACKENDS"], _backends["TRITON_BACKENDS"]
MAX_SEED = 2**32 - 1  # numpy.random.seed takes [0, 2**32 - 1]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs themselves
AUTO = ("auto", True, False)  # a switch: on, off, or decided by the device (resolve_switches)


class ConfigError(ValueError):
    pass


def choice(default, choices):
    """A dataclass field whose value must be one of `choices`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def parse_config(config_class, argv=None, check=None, usage=""):
    """Build a `config_class` from argv (default sys.argv[1:]); exit 2 on a bad key or value, or
    on a ConfigError from `check(config)`. --help prints `usage` above the keys."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(f"{usage.strip()}\n\n{describe(config_class)}" if usage else describe(config_class))
        sys.exit(0)
    try:
        config = build_config(config_class, argv)
        if check is not None:
            check(config)
        return config
    except ConfigError as e:
        exit_bad_config(e)


def exit_bad_config(error):
    print(f"config error: {error}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)


def join_overrides(argv):
    """The arguments with each `--key value` pair joined into `--key=value`, as argparse users expect."""
    joined = []
    for arg in argv:
        previous = joined[-1] if joined else ""
        if not arg.startswith("--") and previous.startswith("--") and "=" not in previous:
            joined[-1] = f"{previous}={arg}"
        else:
            joined.append(arg)
    return joined


def config_files(argv):
    """The config files among the arguments: everything that is not a --key=value."""
    return [arg for arg in join_overrides(argv) if not arg.startswith("--")]


def build_config(config_class, argv):
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    values = {}
    for path in config_files(argv):
        for key, value in read_config_file(path).items():
            where = f"{key} (set in {path})"
            values[key] = check_value(lookup_field(fields, key, where), value, where)
    for arg in join_overrides(argv):
        if not arg.startswith("--"):
            continue
        key, sep, text = arg[2:].partition("=")
        if not sep:
            raise ConfigError(f"{arg!r}: overrides are written --key=value (or --key value)")
        field = lookup_field(fields, key, f"--{key}")
        values[key] = check_value(field, parse_text(field, text, f"--{key}"), f"--{key}")
    return config_class(**values)


def read_config_file(path):
    """The top-level names a config file assigns (modules and _private names skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except BaseException as e:  # sys.exit(0) or Ctrl-C in a config file is a bad config too, not the script's end
        raise ConfigError(f"config file {path!r} failed to run: {type(e).__name__}: {e}") from None
    return {key: value for key, value in namespace.items()
            if not key.startswith("_") and not isinstance(value, types.ModuleType)}


def lookup_field(fields, key, where):
    if key in fields:
        return fields[key]
    close = difflib.get_close_matches(key, fields, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown key {where}{hint}; valid keys: {', '.join(fields)}")


def field_types(field):
    return typing.get_args(field.type) or (field.type,)


def parse_text(field, text, where):
    """The value of a command-line string for a field of type bool, int, float, str, or a union of them."""
    for kind in field_types(field):
        if kind is bool and text.lower() in ("true", "1", "yes", "false", "0", "no"):
            return text.lower() in ("true", "1", "yes")
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                continue
        if kind is str:
            return text
    raise ConfigError(f"{where}={text!r}: expected {type_name(field)}")


def check_value(field, value, where):
    """Type-check `value` for `field` (an int is accepted for a float) and its choices."""
    kinds = field_types(field)
    if float in kinds and type(value) is int:
        value = float(value)
    if type(value) not in kinds:
        raise ConfigError(f"{where}={value!r}: expected {type_name(field)}, got {type(value).__name__}")
    choices = field.metadata.get("choices")
    # By type as well as value: 1 == True, but 1 is not the switch's True.
    if choices is not None and not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(f"{where}={value!r}: valid choices are {', '.join(map(str, choices))}")
    return value


def type_name(field):
    names = {bool: "a bool", int: "an int", float: "a float", str: "a string"}
    return " or ".join(names.get(kind, str(kind)) for kind in field_types(field))


def field_meanings(config_class):
    """{key: its one-line meaning}: the comment that ends the key's line in the class source."""
    matches = (re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)", line) for line in inspect.getsource(config_class).splitlines())
    return {match[1]: match[2].strip() for match in matches if match}


def describe(config_class):
    """Every key with its default, type or choices, and meaning: what --help prints."""
    meanings = field_meanings(config_class)
    lines = [f"{config_class.__name__} keys (set in config files, or as --key=value or --key value):"]
    for field in dataclasses.fields(config_class):
        choices = field.metadata.get("choices")
        kind = f"one of {', '.join(map(str, choices))}" if choices else " or ".join(t.__name__ for t in field_types(field))
        lines.append(f"  --{field.name}={field.default!r}  ({kind})")
        if field.name in meanings:
            lines.append(f"      {meanings[field.name]}")
    return "\n".join(lines)


@dataclass
class TrainConfig:
    """The default run (configs/shakespeare.py names it; GPTConfig's defaults are its model): an
    8-layer GPT on TinyShakespeare's 11,706 GPT-2 tokens, sized so that every backend, eager
    included, fits a 12 GB card. A comment above a key says why its default; the one ending its
    line is its meaning in --help."""
    # output, evaluation, checkpoints
    out_dir: str = "out-shakespeare"  # for ckpt.pt, resume.pt, metrics.jsonl, config.json; relative to the current dir
    init_from: str = choice("scratch", ("scratch", "resume"))  # resume: continue from out_dir/resume.pt (else ckpt.pt)
    overwrite: bool = False  # True: a run from scratch may replace the run in out_dir (its checkpoints and metrics)
    # A run of a few hundred steps: evaluate often enough to see where val loss bottoms out.
    eval_interval: int = 100  # evaluate (and checkpoint) every this many iterations
    eval_iters: int = 50  # batches per split in each evaluation
    log_interval: int = 10  # print and log a line every this many iterations
    # 19M parameters on 302k training tokens can overfit: keep the best checkpoint, not the latest.
    always_save_checkpoint: bool = False  # True: save ckpt.pt at every evaluation, not only when val loss improves
    # wandb (off by default; WANDB_MODE=offline writes a run folder for `wandb sync` instead of uploading)
    wandb_log: bool = False  # log to wandb as well
    wandb_project: str = "nanoFA2"  # the wandb project
    wandb_run_name: str = ""  # the wandb run name; "": "<attn>-<config file name>", e.g. triton-shakespeare
    # data
    data_dir: str = DEFAULT_DATA_DIR  # token files, prepared here if missing; default in the repo, a given path relative to the current dir
    # 4,096 tokens a step: on this small corpus more, smaller steps generalised better. A
    # 512-token context makes attention a large share of the step, while eager's scores still fit.
    batch_size: int = 4  # sequences per micro-batch, per process
    gradient_accumulation_steps: int = 2  # micro-batches per optimizer step, over all processes
    block_size: int = 512  # context length in tokens
    # model: 12 heads of 32 dims rather than 6 of 64, the same FLOPs but twice the score matrices
    # FlashAttention saves, so the backends differ more (val loss the same within the seed's spread).
    n_layer: int = 8  # transformer blocks
    n_head: int = 12  # attention heads; n_embd / n_head is the head dim
    n_kv_head: int = 0  # key/value heads, a divisor of n_head (grouped-query attention); 0: n_head
    n_embd: int = 384  # model width
    window: int = -1  # a sliding window: each query sees itself and this many keys before it; -1: every key before it
    # The run sees each token many times: heavy dropout and weight decay hold off memorising.
    dropout: float = 0.35  # on embeddings, residual branches and the MLP (not inside attention)
    bias: bool = False  # biases in Linear layers and LayerNorms
    attn: str = choice("eager", BACKENDS)  # the attention backend (attention.BACKENDS)
    # Linear warmup, then cosine decay to zero where val loss stops improving, so the last
    # checkpoint is near the best: a longer run only memorises.
    learning_rate: float = 6e-4  # peak learning rate, reached after warmup_iters
    max_iters: int = 2000  # optimizer steps to train for
    weight_decay: float = 0.5  # AdamW weight decay, on matrices only
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 turns clipping off
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: int = 2000  # the cosine decay reaches min_lr here
    min_lr: float = 0.0  # the final learning rate
    # system. On a GPU the host issuing hundreds of small kernels sets the pace unless the step
    # is compiled and replayed from a graph, so both are on there; on the CPU they gain nothing.
    device: str = choice("auto", ("auto", "cpu", "cuda"))  # auto: cuda if torch sees a GPU, else cpu
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))  # auto: bf16 autocast on GPUs that have it, else fp16; fp32 on the CPU
    compile: bool | str = choice("auto", AUTO)  # torch.compile the model; auto: on where CUDA is the device
    compile_mode: str = choice("default", COMPILE_MODES)  # torch.compile's mode; reduce-overhead, max-autotune: CUDA graphs of their own
    cuda_graph: bool | str = choice("auto", AUTO)  # replay each step's forward and backward from one CUDA graph; auto: on where CUDA is the device, off with profile, torchrun or a compile_mode that captures graphs itself
    profile: bool = False  # profile a few steady steps with torch.profiler into out_dir/profile.json (profiling.py)
    max_memory_gb: float = 0.0  # cap torch's CUDA memory at this many GiB, e.g. 12 to act as a 12 GB card; 0: no cap
    seed: int = 1337  # seeds the weights, dropout and batches (process rank uses seed + rank)

    def model_config(self, vocab_size):
        """The GPTConfig of the model these settings train, over vocab_size token ids."""
        from model import GPTConfig  # here, not at the top: this module loads without torch

        shared = [f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size"]
        return GPTConfig(vocab_size=vocab_size, **{name: getattr(self, name) for name in shared})


def parse_train_config(usage):
    """train.py's settings from its arguments, checked, with the default wandb run name filled in:
    "<attn>-<config files>", e.g. triton-shakespeare. Exits 2 on a bad setting."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # the processes torchrun started
    config = parse_config(TrainConfig, check=lambda c: (check_config(c, world_size), check_paths(c)), usage=usage)
    files = "+".join(os.path.splitext(os.path.basename(path))[0] for path in config_files(sys.argv[1:]))
    return config if config.wandb_run_name else dataclasses.replace(
        config, wandb_run_name=f"{config.attn}-{files or 'shakespeare'}")


def check_config(config, world_size=1):
    """Raise ConfigError for the first rule `config` breaks; world_size: torchrun's processes."""
    graph_conflicts = cuda_graph_conflicts(config, config.compile is not False, world_size)
    at_least_1 = ("eval_interval", "eval_iters", "log_interval", "batch_size", "gradient_accumulation_steps",
                  "block_size", "n_layer", "n_head", "lr_decay_iters")
    rules = [
        *[(key, getattr(config, key) >= 0, "an int >= 0") for key in ("max_iters", "warmup_iters")],
        *[(key, getattr(config, key) >= 1, "an int >= 1") for key in at_least_1],
        ("wandb_project", config.wandb_project != "", "a non-empty project name"),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps % world_size == 0,
         f"a multiple of the {world_size} processes torchrun started (each runs "
         f"gradient_accumulation_steps / {world_size} micro-batches per step)"),
        ("n_embd", config.n_embd >= 1 and config.n_embd % max(config.n_head, 1) == 0,
         f"a positive multiple of n_head={config.n_head}"),
        ("n_kv_head", config.n_kv_head == 0 or (config.n_kv_head >= 1 and config.n_head % config.n_kv_head == 0),
         f"0 (as many as n_head) or a divisor of n_head={config.n_head}"),
        ("window", -1 <= config.window < 2 ** 63, "-1 (every key before the query) or an int >= 0 below 2**63"),
        *[(key, 0.0 <= getattr(config, key) < 1.0, "in [0, 1)") for key in ("dropout", "beta1", "beta2")],
        ("learning_rate", 0.0 < config.learning_rate < math.inf, "a finite float > 0"),
        *[(key, 0.0 <= getattr(config, key) < math.inf, "a finite float >= 0")
          for key in ("min_lr", "weight_decay")],
        ("grad_clip", 0.0 <= config.grad_clip < math.inf, "a finite float >= 0 (0: no clipping)"),
        ("max_memory_gb", 0.0 <= config.max_memory_gb < math.inf, "a finite float >= 0 (0: no cap)"),
        ("max_memory_gb", not (config.max_memory_gb and config.device == "cpu"), "0 with device='cpu' (it caps CUDA memory)"),
        ("dtype", not (config.dtype == "float16" and config.device == "cpu"), "float32 or bfloat16 on the CPU"),
        ("cuda_graph", not (config.cuda_graph is True and config.device == "cpu"), "False or auto with device='cpu'"),
        ("cuda_graph", not (config.cuda_graph is True and graph_conflicts), f"False or auto {graph_conflicts}"),
        # Process r seeds numpy with seed + r, so the largest rank must stay in range too.
        ("seed", 0 <= config.seed <= MAX_SEED - (world_size - 1),
         f"an int in [0, {MAX_SEED - (world_size - 1)}] (numpy's seed range; process r of {world_size} uses seed + r)"),
    ]
    first_broken(config, rules)
    check_attn_head_dim(config.attn, config.n_embd, config.n_head)


def first_broken(config, rules):
    """Raise ConfigError for the first (key, ok, expected) rule that is not ok."""
    for key, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{key}={getattr(config, key)!r}: expected {expected}")


def cuda_graph_conflicts(config, compiled, world_size):
    """Why the step cannot be one CUDA graph with these settings ("" when it can)."""
    if compiled and config.compile_mode in CUDA_GRAPH_COMPILE_MODES:
        return f"with compile_mode={config.compile_mode!r}, which captures CUDA graphs of its own " \
               "(use compile_mode=default or max-autotune-no-cudagraphs)"
    if world_size > 1:
        return f"under torchrun with {world_size} processes (DDP's all-reduce is not captured here)"
    if config.profile:
        return ("with profile=True (the profile sorts kernels by the ranges the host marks as it launches them, "
                "and a graph replay launches them all at once)")
    return ""


def resolve_switches(config, device_type, world_size=1):
    """config with compile and cuda_graph decided: "auto" is on where the device is CUDA; the
    graph quietly yields to what it cannot capture (check_config refuses an explicit True)."""
    compiled = device_type == "cuda" if config.compile == "auto" else config.compile
    cuda_graph = config.cuda_graph
    if cuda_graph == "auto":
        cuda_graph = device_type == "cuda" and not cuda_graph_conflicts(config, compiled, world_size)
    if cuda_graph and device_type != "cuda":
        raise ConfigError(f"cuda_graph=True needs a CUDA device; this run is on {device_type} (use cuda_graph=False)")
    return dataclasses.replace(config, compile=compiled, cuda_graph=cuda_graph)


def check_attn_head_dim(attn, n_embd, n_head):
    """The Triton kernels take head dims that are multiples of 8 up to 256; the other backends take any."""
    head_dim = n_embd // n_head
    if attn in TRITON_BACKENDS and (head_dim % 8 or head_dim > 256):
        raise ConfigError(f"attn={attn!r} with n_embd={n_embd} and n_head={n_head}: the head dim n_embd / n_head "
                          f"= {head_dim} must be a multiple of 8, at most 256, for the Triton kernels "
                          "(eager, tiled and sdpa take any head dim)")


def check_paths(config):
    """Refuse an out_dir or data_dir this run cannot use, before anything is made."""
    check_folder("out_dir", config.out_dir, writable=True)
    data_files = [os.path.join(config.data_dir, name) for name in ("meta.json", "train.bin", "val.bin")]
    unprepared = not all(map(os.path.isfile, data_files))
    check_folder("data_dir", config.data_dir, writable=unprepared)
    if unprepared:
        check_no_run_in_progress(config.data_dir)
    for name in (CHECKPOINT_NAME, RESUME_NAME, METRICS_NAME, CONFIG_NAME):
        path = os.path.join(config.out_dir, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ConfigError(f"{path} is not a file (a folder?); train.py writes its {name} there: move it away")
    check_no_run(config)


def check_folder(key, path, writable):
    """A folder at `path`, or none yet and one that can be made there; writable if asked."""
    if not path:  # os.path.abspath('') is the current folder, os.makedirs('') an error
        raise ConfigError(f"{key}='': expected a folder's path (made if missing), got an empty one; '.' is the "
                          "current folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file; expected a folder (made if missing)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    problem = (f"Not a directory: {existing} is a file" if not os.path.isdir(existing) else
               f"Permission denied in {existing}" if writable and not os.access(existing, os.W_OK | os.X_OK) else None)
    if problem:
        raise ConfigError(f"{key}={path!r}: cannot write there ({problem}); expected a folder this user can write "
                          "(made if missing)")


def check_no_run_in_progress(data_dir):
    """prepare.py writes the data under data_dir's lock, which a train.py run holds on its out_dir
    for as long as it runs: data_dir being such a run's out_dir, the data would wait for that run
    to end. Its run files tell that holder from another prepare.py, which is worth waiting for."""
    run_files = [name for name in (CONFIG_NAME, METRICS_NAME) if os.path.exists(os.path.join(data_dir, name))]
    if not run_files or not os.path.isdir(data_dir):
        return
    try:
        with folder_lock(data_dir, wait=False):
            return
    except BlockingIOError:
        raise ConfigError(f"data_dir={data_dir!r} is the out_dir of a train.py run in progress (it holds the folder's "
                          f"lock, and its {run_files[0]} is there): the data would wait for that run to end. Give the "
                          f"data a folder of its own (the default is {DEFAULT_DATA_DIR})") from None


def check_no_run(config):
    """A run from scratch replaces no run in out_dir unless overwrite=True. Checked with the
    settings, and again by train.py under out_dir's lock, where no other run can write one."""
    metrics = os.path.join(config.out_dir, METRICS_NAME)
    held = ([name for name in (CHECKPOINT_NAME, RESUME_NAME) if os.path.exists(os.path.join(config.out_dir, name))]
            + ([METRICS_NAME] if os.path.isfile(metrics) and os.path.getsize(metrics) else []))
    if config.init_from == "scratch" and held and not config.overwrite:
        raise ConfigError(f"out_dir={config.out_dir!r} holds a run ({', '.join(held)}), which a run from scratch "
                          "would replace. Continue it with --init_from=resume, replace it with --overwrite=True, "
                          "or pick another out_dir")


# Much below this, logits / temperature overflows float16 (|logit| > 655) and the softmax turns
# NaN; sampling is greedy in effect by then, which --top_k=1 does exactly.
MIN_TEMPERATURE = 0.01


@dataclass
class SampleConfig:
    """sample.py's settings."""
    out_dir: str = "out-shakespeare"  # the folder holding ckpt.pt
    init_from: str = choice("checkpoint", ("checkpoint", "random"))  # random: untrained, the default run's shape
    n_kv_head: int = 0  # init_from=random: key/value heads, a divisor of 12 (grouped-query attention); 0: 12
    window: int = -1  # init_from=random: each query sees itself and this many keys before it; -1: every key before it
    start: str = "\n"  # the prompt, or FILE:path to read it from a file, e.g. FILE:data/shakespeare/prompt.txt; no <|endoftext|> (see above)
    num_samples: int = 2  # samples to generate; with --benchmark=True, the batch decoded side by side
    max_new_tokens: int = 300  # tokens to generate after the prompt
    temperature: float = 0.8  # < 1 sharpens the distribution, > 1 flattens it; at least MIN_TEMPERATURE
    top_k: int = 200  # sample from the k likeliest tokens only; 0 for all
    seed: int = 1337  # seeds the sampling (and a random-init model); 0 to 2**64 - 1, torch's range
    attn: str = choice("checkpoint", ("checkpoint",) + BACKENDS)  # "checkpoint": the one it trained with
    kv_cache: bool = True  # keep each layer's keys and values, feed one new token per step
    compile: bool = False  # compile the one-token decode step (needs kv_cache=True) with Inductor
    benchmark: bool = False  # print decode tokens/s with and without the KV cache (every backend unless --attn; on the CPU not the Triton ones)
    device: str = choice("auto", ("auto", "cpu", "cuda"))  # auto: cuda if torch sees a GPU, else cpu
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))  # auto: bf16 or fp16 on a GPU, fp32 on the CPU; bf16 casts the weights, fp16 is autocast


def check_sample_config(config):
    rules = [
        *[(key, getattr(config, key) >= 1, "an int >= 1") for key in ("num_samples", "max_new_tokens")],
        ("temperature", MIN_TEMPERATURE <= config.temperature < math.inf,
         f"a finite float >= {MIN_TEMPERATURE} (for greedy decoding use --top_k=1)"),
        ("top_k", config.top_k >= 0, "an int >= 0 (0: no top-k)"),
        ("seed", 0 <= config.seed < 2**64, "an int in [0, 2**64 - 1], torch's seed range"),
        ("start", config.start not in ("", "FILE:"), "a non-empty prompt or FILE:path"),
        ("compile", config.kv_cache or not config.compile, "False when kv_cache=False (it compiles the cached step)"),
        ("dtype", not (config.dtype == "float16" and config.device == "cpu"), "float32 or bfloat16 on the CPU"),
        ("n_kv_head", config.n_kv_head == 0 or (config.n_kv_head >= 1 and TrainConfig.n_head % config.n_kv_head == 0),
         f"0 or a divisor of the default run's {TrainConfig.n_head} heads"),
        ("window", -1 <= config.window < 2 ** 63, "-1 (every key before the query) or an int >= 0 below 2**63"),
        ("n_kv_head", config.init_from == "random" or config.n_kv_head == 0,
         "0 with a checkpoint, whose model has its own (it shapes a random-init model)"),
        ("window", config.init_from == "random" or config.window == -1,
         "-1 with a checkpoint, whose model has its own (it shapes a random-init model)"),
    ]
    first_broken(config, rules)
