"""train.py's settings: typed defaults and the rules that involve a value's range or
several keys. A module of its own so that compare.py checks the train.py arguments it passes
on before starting any run (nothing imports train.py itself)."""
import math
from dataclasses import dataclass

from attention import BACKENDS
from data.shakespeare.prepare import DEFAULT_OUT_DIR as DEFAULT_DATA_DIR
from model import GPTConfig
from training.configurator import ConfigError, choice

TRITON_BACKENDS = ("triton", "triton_fwd")
MAX_SEED = 2**32 - 1  # numpy.random.seed takes [0, 2**32 - 1]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs themselves


@dataclass
class TrainConfig:
    """The defaults are the GPU run (configs/shakespeare.py names it): an 8-layer GPT on
    TinyShakespeare's GPT-2 tokens (11,706 of them, renumbered densely by prepare.py), sized to
    fit a 12 GB card with every attention backend, eager included. The comments above a key say
    why its default; the comment ending its line is its meaning in --help."""
    # output, evaluation, checkpoints
    out_dir: str = "out-shakespeare"  # for ckpt.pt, metrics.jsonl, config.json; relative to the current dir
    init_from: str = choice("scratch", ("scratch", "resume"))  # resume: continue from out_dir/ckpt.pt
    overwrite: bool = False  # True: a run from scratch may replace the run in out_dir (its ckpt.pt and metrics.jsonl)
    # The whole run is a few hundred steps: evaluate often enough to see where val loss bottoms
    # out. 50 batches of 4,096 tokens cover the 36k val tokens many times over.
    eval_interval: int = 100  # evaluate (and checkpoint) every this many iterations
    eval_iters: int = 50  # batches per split in each evaluation
    log_interval: int = 10  # print and log a line every this many iterations
    # 19M parameters on 302k training tokens can overfit: keep the checkpoint with the best val
    # loss rather than the latest.
    always_save_checkpoint: bool = False  # True: save at every evaluation, not only when val loss improves
    # wandb (off by default; WANDB_MODE=offline writes a run folder for `wandb sync` instead of uploading)
    wandb_log: bool = False  # log to wandb as well
    wandb_project: str = "nanoFA2"  # the wandb project
    wandb_run_name: str = ""  # the wandb run name; "": "<attn>-<config file name>", e.g. triton-shakespeare
    # data
    data_dir: str = DEFAULT_DATA_DIR  # token files, prepared here if missing; default in the repo, a given path relative to the current dir
    # 4 x 512 tokens per micro-batch, two micro-batches: 4,096 tokens per optimizer step. On this
    # small corpus more, smaller steps generalised better than fewer large ones (.ci/gpu recipe;
    # docs/benchmarks.md has the candidates and their val losses).
    batch_size: int = 4  # sequences per micro-batch, per process
    gradient_accumulation_steps: int = 2  # micro-batches per optimizer step, over all processes
    # A 512-token context makes attention a large share of the step (its cost grows with the
    # context, the matmuls' does not), which is what a comparison of attention backends needs,
    # while eager's per-layer block_size^2 scores still fit a 12 GB card at this batch.
    block_size: int = 512  # context length in tokens
    # model
    # 12 heads of 32 dims rather than 6 of
    # 64: the same parameters and FLOPs, but twice the block_size^2 score matrices, the work
    # FlashAttention saves, so the backends differ more. Val loss was the same within the seed's
    # spread (.ci/gpu recipe, round 5).
    n_layer: int = 8  # transformer blocks
    n_head: int = 12  # attention heads; n_embd / n_head is the head dim
    n_embd: int = 384  # model width
    # One pass over the training data is ~74 steps of 4k tokens, so the run sees each token many
    # times: heavy dropout and weight decay hold off memorising it.
    dropout: float = 0.35  # on embeddings, residual branches and the MLP (not inside attention)
    bias: bool = False  # biases in Linear layers and LayerNorms
    attn: str = choice("eager", BACKENDS)  # the attention backend (attention.BACKENDS)
    # optimizer and schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
    # The learning rate decays to zero where val loss stops improving, so val loss flattens rather
    # than climbs at the end and the last checkpoint is near the best: a longer run only memorises.
    learning_rate: float = 6e-4  # peak learning rate, reached after warmup_iters
    max_iters: int = 2000  # optimizer steps to train for
    weight_decay: float = 0.5  # AdamW weight decay, on matrices only
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 turns clipping off
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: int = 2000  # the cosine decay reaches min_lr here
    min_lr: float = 0.0  # the final learning rate
    # system
    device: str = choice("auto", ("auto", "cpu", "cuda"))  # auto: cuda if torch sees a GPU, else cpu
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))  # auto: bf16 autocast on GPUs that have it, else fp16; fp32 on the CPU
    compile: bool = False  # torch.compile the model
    compile_mode: str = choice("default", COMPILE_MODES)  # torch.compile's mode; reduce-overhead, max-autotune: CUDA graphs (none on the CPU)
    # Off by default, like nanoGPT's loop: a graph costs a capture and memory held for it, and
    # pays off where the host, not the GPU, sets the step time (training/step_graph.py says why).
    cuda_graph: bool = False  # capture each step's forward and backward passes in one CUDA graph and replay it (CUDA only)
    profile: bool = False  # profile a few steady steps with torch.profiler into out_dir/profile.json (profiling.py)
    max_memory_gb: float = 0.0  # cap torch's CUDA memory at this many GiB, e.g. 12 to act as a 12 GB card; 0: no cap
    seed: int = 1337  # seeds the weights, dropout and batches (process rank uses seed + rank)

    def model_config(self, vocab_size):
        """The GPTConfig of the model these settings train, over vocab_size token ids."""
        return GPTConfig(block_size=self.block_size, vocab_size=vocab_size, n_layer=self.n_layer, n_head=self.n_head,
                         n_embd=self.n_embd, dropout=self.dropout, bias=self.bias, attn=self.attn)


def check_config(config, world_size=1):
    """Raise ConfigError for the first rule `config` breaks; world_size is the number of
    training processes (torchrun's WORLD_SIZE), which must divide the accumulation steps."""
    rules = [
        ("max_iters", config.max_iters >= 0, "an int >= 0"),
        ("eval_interval", config.eval_interval >= 1, "an int >= 1"),
        ("eval_iters", config.eval_iters >= 1, "an int >= 1"),
        ("log_interval", config.log_interval >= 1, "an int >= 1"),
        ("wandb_project", config.wandb_project != "", "a non-empty project name"),
        ("batch_size", config.batch_size >= 1, "an int >= 1"),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps >= 1, "an int >= 1"),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps % world_size == 0,
         f"a multiple of the {world_size} processes torchrun started (each runs "
         f"gradient_accumulation_steps / {world_size} micro-batches per step)"),
        ("block_size", config.block_size >= 1, "an int >= 1"),
        ("n_layer", config.n_layer >= 1, "an int >= 1"),
        ("n_head", config.n_head >= 1, "an int >= 1"),
        ("n_embd", config.n_embd >= 1 and config.n_embd % max(config.n_head, 1) == 0,
         f"a positive multiple of n_head={config.n_head}"),
        ("dropout", 0.0 <= config.dropout < 1.0, "in [0, 1)"),
        ("learning_rate", 0.0 < config.learning_rate < math.inf, "a finite float > 0"),
        ("min_lr", 0.0 <= config.min_lr < math.inf, "a finite float >= 0"),
        ("warmup_iters", config.warmup_iters >= 0, "an int >= 0"),
        ("lr_decay_iters", config.lr_decay_iters >= 1, "an int >= 1"),
        ("weight_decay", 0.0 <= config.weight_decay < math.inf, "a finite float >= 0"),
        ("beta1", 0.0 <= config.beta1 < 1.0, "in [0, 1)"),
        ("beta2", 0.0 <= config.beta2 < 1.0, "in [0, 1)"),
        ("grad_clip", 0.0 <= config.grad_clip < math.inf, "a finite float >= 0 (0: no clipping)"),
        ("max_memory_gb", 0.0 <= config.max_memory_gb < math.inf, "a finite float >= 0 (0: no cap)"),
        ("cuda_graph", not (config.cuda_graph and config.compile and config.compile_mode in CUDA_GRAPH_COMPILE_MODES),
         f"False with compile_mode={config.compile_mode!r}, which captures CUDA graphs of its own "
         "(use compile_mode=default or max-autotune-no-cudagraphs)"),
        ("cuda_graph", not (config.cuda_graph and world_size > 1),
         f"False under torchrun with {world_size} processes (DDP's all-reduce is not captured here)"),
        ("cuda_graph", not (config.cuda_graph and config.profile),
         "False with profile=True (the profile sorts kernels by the ranges the host marks as it launches "
         "them, and a graph replay launches them all at once)"),
        # Process r seeds numpy with seed + r, so the largest rank must stay in range too.
        ("seed", 0 <= config.seed <= MAX_SEED - (world_size - 1),
         f"an int in [0, {MAX_SEED - (world_size - 1)}] (numpy's seed range; process r of {world_size} uses seed + r)"),
    ]
    for key, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{key}={getattr(config, key)!r}: expected {expected}")
    check_attn_head_dim(config.attn, config.n_embd, config.n_head)


def check_attn_head_dim(attn, n_embd, n_head):
    """The Triton kernels take only some head dims; the other backends take any."""
    head_dim = n_embd // n_head
    if attn in TRITON_BACKENDS and (head_dim % 8 or head_dim > 256):
        raise ConfigError(f"attn={attn!r} with n_embd={n_embd} and n_head={n_head}: the head dim n_embd / n_head "
                          f"= {head_dim} must be a multiple of 8, at most 256, for the Triton kernels "
                          "(eager, tiled and sdpa take any head dim)")
