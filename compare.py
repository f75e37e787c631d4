r"""Train the same model with each attention backend and compare them: loss curves, step
time, throughput and memory.

    python compare.py configs/tiny.py --max_iters=20                 # every backend, on the CPU
    python compare.py configs/shakespeare.py --backends=eager,triton,sdpa --max_iters=500
    python compare.py --from_runs=out-a,out-b                        # runs train.py made before
    python compare.py --backends=eager,triton,sdpa --max_iters=30 --profile=True --compile_both=True
                                                                     # where each step's time goes

Each backend trains in a subprocess of train.py with the same config and seed (so the same
weights and batches), every train.py key passed on, logging every iteration and evaluating five
times unless told otherwise. Writes to --out: runs/<backend>/ (each run's out_dir and train.log),
compare.md and compare.png (loss curves, their distance from eager's, steady-state step time,
tokens/s, MFU, peak memory) and, with --profile=True, profile.png and a table of where each
step's time goes (training/profiling.py). Steady state leaves out train.py's warm-up steps. A
failed run is marked with its exit status and last line, and the others go on. --from_runs says
when the runs differ in more than the backend. Time and memory against context: bench.py --mode=step.

Exit status: 0 done; 1 a run failed other than by running out of memory (after the others ran
and the report was written); 2 bad arguments (a corrupt --from_runs config.json too); 130
interrupted by Ctrl-C (the run in progress saves its checkpoint, as train.py does).
"""
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field, fields, replace

import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm

from training.config import (BACKENDS, CONFIG_NAME, EXIT_ERROR, EXIT_OUT_OF_MEMORY, METRICS_NAME, TRITON_BACKENDS,
                             ConfigError, TrainConfig, check_config, check_folder, describe, join_overrides,
                             parse_config)
from training.profiling import CATEGORIES, PROFILE_NAME, read_profile
from training.run_files import EVAL_KEYS, LOG_KEYS, RunFileError, read_metrics, read_run_config

TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
SET_PER_RUN = {"attn": "--backends", "out_dir": "--out"}  # train.py keys compare.py sets itself
# The config.json keys the report reads (describe_setup), each with the types train.py writes.
SETUP_KEYS = {**dict.fromkeys(("attn", "device", "dtype"), (str,)), "gpu": (str, type(None)),
              **dict.fromkeys(("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                               "tokens_per_iter", "max_iters", "seed"), (int,))}
# A metrics record's values by key, where not a number: what the report and its figure compute with.
RECORD_TYPES = {"iter": (int,), "warmup": (bool,), "mfu": (int, float, type(None)),
                "peak_mem_mb": (int, float, type(None))}
# profile.json's values the report reads, besides each category's ms (training/profiling.py writes them).
PROFILE_TYPES = {"device": (str,), "steps": (int,), "step_ms": (int, float), "peak_mem_mb": (int, float, type(None)),
                 "attention_saved_mb": (int, float, type(None))}
TYPE_NAMES = {str: "a string", int: "an int", float: "a float", bool: "a bool", type(None): "None"}
# Settings that may differ between runs compared step for step: the backend, and where a run logs.
MAY_DIFFER = {"attn", "out_dir", "init_from", "overwrite", "wandb_log", "wandb_project", "wandb_run_name"}
PROGRESS_LINE = re.compile(r"iter (\d+): loss (\S+),")  # train.py's log lines
REFERENCE = "eager"  # the backend every loss curve is measured against
COLORS = {backend: f"C{i}" for i, backend in enumerate(BACKENDS)}
CPU_TRITON_NOTE = ("On the CPU, triton and triton_fwd run in Triton's interpreter (numpy): their step time and "
                   "tokens/s are the interpreter's, not the kernels', which is why they rank last here.")


@dataclass
class CompareConfig:
    backends: str = ",".join(BACKENDS)  # comma-separated, trained in this order
    out: str = "out-compare"
    from_runs: str = ""  # comma-separated train.py out_dirs to compare, instead of training
    profile: bool = False  # profile a few steady steps of each run (train.py --profile=True): profile.png
    compile_both: bool = False  # train each backend twice, uncompiled and with torch.compile


@dataclass
class Run:
    label: str  # the backend, unless two runs share one
    out_dir: str
    config: dict = field(default_factory=dict)  # config.json
    records: list = field(default_factory=list)  # metrics.jsonl
    out_of_memory: bool = False
    failure: str = ""  # for a run that failed otherwise: its exit status and last line of output

    @property
    def finished(self):
        return not (self.out_of_memory or self.failure)


def split_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def check_compare_config(config, passed_on):
    """The rules for compare.py's own keys, and for the train.py arguments it passes on."""
    backends = split_list(config.backends)
    unknown = [b for b in backends if b not in BACKENDS]
    if not backends or unknown or len(set(backends)) != len(backends):
        raise ConfigError(f"backends={config.backends!r}: expected distinct names from {', '.join(BACKENDS)}, "
                          "comma-separated")
    if (config.profile or config.compile_both) and config.from_runs:
        raise ConfigError("profile and compile_both apply to the comparison of backends, not to from_runs "
                          "(which shows any profile.json its runs hold)")
    if config.compile_both and any(arg.startswith("--compile=") for arg in passed_on):
        raise ConfigError("--compile: compile_both=True trains every backend both ways; give one or the other")
    check_folder("out", config.out, writable=True)
    if config.from_runs and not split_list(config.from_runs):
        raise ConfigError(f"from_runs={config.from_runs!r}: expected the out_dirs of train.py runs, comma-separated")
    for out_dir in split_list(config.from_runs):
        check_finished_run(out_dir)
    for arg in passed_on:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in SET_PER_RUN:
            raise ConfigError(f"--{key}: compare.py sets it for each run; use {SET_PER_RUN[key]}=...")
        if config.from_runs:
            raise ConfigError(f"{arg}: from_runs compares finished runs, so train.py settings do not apply")


def check_finished_run(out_dir):
    """A ConfigError unless out_dir holds a train.py run's config.json and metrics.jsonl, with
    the keys the report reads and at least one log record."""
    config_path, metrics_path = os.path.join(out_dir, CONFIG_NAME), os.path.join(out_dir, METRICS_NAME)
    for path in (config_path, metrics_path):
        if not os.path.isfile(path):
            raise ConfigError(f"from_runs: {out_dir} has no {os.path.basename(path)}; expected the out_dir of a "
                              "train.py run")
    try:
        run_config, records = read_run_config(out_dir), read_metrics(out_dir)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and json's errors are ValueErrors
        raise ConfigError(f"from_runs: {config_path} cannot be read ({e})") from None
    except RunFileError as e:
        raise ConfigError(f"from_runs: {e}") from None
    missing = [key for key in SETUP_KEYS if key not in run_config] if isinstance(run_config, dict) else ["all"]
    if missing:
        raise ConfigError(f"from_runs: {config_path} is not a train.py config.json (it lacks {', '.join(missing)})")
    for key, kinds in SETUP_KEYS.items():
        if type(run_config[key]) not in kinds:
            raise ConfigError(f"from_runs: {config_path} has {key}={run_config[key]!r}, expected {type_names(kinds)}")
    if not any("loss" in record for record in records):
        raise ConfigError(f"from_runs: {metrics_path} holds no log records; expected the metrics of a train.py run")
    for record in records:
        keys = LOG_KEYS if "loss" in record else EVAL_KEYS
        if not set(keys) <= record.keys():
            raise ConfigError(f"from_runs: {metrics_path} has a record without {', '.join(set(keys) - record.keys())}"
                              " (a train.py of another version?): " + repr(record)[:80])
        for key in keys:
            kinds = RECORD_TYPES.get(key, (int, float))
            if type(record[key]) not in kinds:
                raise ConfigError(f"from_runs: {metrics_path} has a record with {key}={record[key]!r}, expected "
                                  f"{type_names(kinds) if key in RECORD_TYPES else 'a number'}: " + repr(record)[:80])
    check_profile(out_dir)


def type_names(kinds):
    return " or ".join(TYPE_NAMES[kind] for kind in kinds)


def check_profile(out_dir):
    """A ConfigError unless out_dir's profile.json, where there is one, holds what compare.md's
    profile table and profile.png read."""
    path = os.path.join(out_dir, PROFILE_NAME)
    try:
        profile = read_profile(out_dir)
    except (OSError, ValueError) as e:  # json's errors are ValueErrors
        raise ConfigError(f"from_runs: {path} cannot be read ({type(e).__name__}: {e})") from None
    if profile is None:
        return
    if not isinstance(profile, dict) or not isinstance(profile.get("ms"), dict):
        raise ConfigError(f"from_runs: {path} is not a train.py profile: it has no ms, the time of each category")
    missing = [category for category in CATEGORIES if type(profile["ms"].get(category)) not in (int, float)]
    if missing:
        raise ConfigError(f"from_runs: {path} is not a train.py profile: its ms lacks {missing[0]} (a number)")
    for key, kinds in PROFILE_TYPES.items():
        if type(profile.get(key)) not in kinds:
            raise ConfigError(f"from_runs: {path} has {key}={profile.get(key)!r}, expected {type_names(kinds)}")


def parse_args(argv):
    """(CompareConfig, the train.py arguments to pass on, their TrainConfig); exits 2 on bad ones.
    The train.py settings are checked with each backend now, not after the first run."""
    if "-h" in argv or "--help" in argv:
        print(f"{__doc__}\n{describe(CompareConfig)}\nand any train.py key (python train.py --help), passed on to "
              "every run")
        sys.exit(0)
    argv = join_overrides(argv)
    own_keys = {f.name for f in fields(CompareConfig)}
    own = [arg for arg in argv if arg.startswith("--") and arg[2:].partition("=")[0] in own_keys]
    passed_on = [arg for arg in argv if arg not in own]
    config = parse_config(CompareConfig, own, check=lambda config: check_compare_config(config, passed_on))
    train_config = parse_config(TrainConfig, passed_on, check=lambda train_config: [
        check_config(replace(train_config, attn=backend)) for backend in split_list(config.backends)])
    return config, passed_on, train_config


def train(label, out_dir, args, total_iters):
    """Run train.py with `args` into out_dir (replacing an earlier run), its output in
    out_dir/train.log, under a progress bar; the Run is marked if it ran out of memory or failed."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "train.log")
    command = [sys.executable, TRAIN_SCRIPT, "--overwrite=True", *args, f"--out_dir={out_dir}"]
    with open(log_path, "w") as log, tqdm(total=total_iters, desc=label, unit="iter", leave=True) as bar:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in process.stdout:
                log.write(line)
                match = PROGRESS_LINE.match(line)
                if match:
                    bar.update(int(match[1]) - bar.n)
                    bar.set_postfix_str(f"loss {match[2]}")
        except KeyboardInterrupt:
            process.wait()  # Ctrl-C reached train.py too: let it save its checkpoint
            raise
        status = process.wait()
        if status == EXIT_OUT_OF_MEMORY:
            bar.set_postfix_str("out of memory")
            return Run(label, out_dir, out_of_memory=True)
    if status != 0:
        with open(log_path) as f:
            last_line = ([line.strip() for line in f if line.strip()] or ["no output"])[-1]
        print(f"{label}: train.py exited with status {status}: {last_line} (all of it in {log_path})",
              file=sys.stderr)
        return Run(label, out_dir, failure=f"exit status {status}: {last_line}")
    return Run(label, out_dir, read_run_config(out_dir), read_metrics(out_dir))


def differing_settings(runs):
    """'key (value in label, value in label, ...)' for each setting in which the runs'
    config.json differ, apart from MAY_DIFFER: their curves are then not comparable."""
    keys = sorted(set().union(*(run.config for run in runs)) - MAY_DIFFER)
    return [f"{key} (" + ", ".join(f"{run.config.get(key)!r} in {run.label}" for run in runs) + ")"
            for key in keys if len({repr(run.config.get(key)) for run in runs}) > 1]


def steady_records(run):
    return [r for r in run.records if "loss" in r and not r["warmup"]]


def median_of(run, key):
    values = [r[key] for r in steady_records(run) if r[key] is not None]
    return statistics.median(values) if values else None


def peak_memory(run):
    values = [r["peak_mem_mb"] for r in run.records if r.get("peak_mem_mb") is not None]
    return max(values) if values else None


def max_difference(run, reference, key):
    """Largest |run - reference| of `key` over the iterations both logged it; None if none."""
    mine = {r["iter"]: r[key] for r in run.records if key in r}
    theirs = {r["iter"]: r[key] for r in reference.records if key in r}
    common = mine.keys() & theirs.keys()
    return max(abs(mine[i] - theirs[i]) for i in common) if common else None


def fmt(value, spec, unit=""):
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def describe_setup(config):
    """One line on what the runs trained: model, batch, device."""
    cap = f", max_memory_gb {config['max_memory_gb']:g}" if config.get("max_memory_gb") else ""
    return (f"{config['n_layer']} layers, {config['n_head']} heads, n_embd {config['n_embd']}, "
            f"block_size {config['block_size']}, batch_size {config['batch_size']} x "
            f"{config['gradient_accumulation_steps']} accumulation ({config['tokens_per_iter']:,} tokens/iter), "
            f"{config['max_iters']} iters, seed {config['seed']}; {config['gpu'] or config['device']}, "
            f"{config['dtype']}{cap}")


def comparison_row(run, reference):
    """A run's row of compare.md's table."""
    if not run.finished:
        return f"| {run.label} | " + ("out of memory |" + " |" * 9 if run.out_of_memory else
                                      f"failed, {run.failure.replace('|', '/')} |" + " |" * 8)
    final = ([r for r in run.records if "val_loss" in r] or [None])[-1]
    step_ms = [r["step_ms"] for r in steady_records(run)]
    spread = f"{np.percentile(step_ms, 10):.1f} - {np.percentile(step_ms, 90):.1f}" if step_ms else "n/a"
    return " | ".join([
        f"| {run.label}", fmt(final and final["train_loss"], ".4f"), fmt(final and final["val_loss"], ".4f"),
        fmt(final and final.get("val_bpc"), ".3f"),
        fmt(median_of(run, "step_ms"), ".1f"), spread, fmt(median_of(run, "tokens_per_s"), ",.0f"),
        fmt(median_of(run, "mfu") and 100 * median_of(run, "mfu"), ".1f", "%"), fmt(peak_memory(run), ",.0f"),
        *(fmt(reference and max_difference(run, reference, key), ".2e") for key in ("loss", "val_loss"))]) + " |"


def write_comparison(runs, out, command):
    os.makedirs(out, exist_ok=True)
    trained = [run for run in runs if run.finished]
    reference = next((run for run in trained if run.config.get("attn") == REFERENCE), None)  # the first
    setup = describe_setup(trained[0].config) if trained else "no run finished"
    notes = "" if reference else f"\nNo {REFERENCE} run finished, so there are no differences from its curves.\n"
    differences = differing_settings(trained)
    if differences:
        notes += ("\n**These runs differ in settings other than the backend, so their curves and times are "
                  "not comparable step for step:** " + "; ".join(differences) + ". The setup line is the first run's.\n")
    if any(run.config["attn"] in TRITON_BACKENDS and run.config.get("gpu") is None for run in trained):
        notes += f"\n{CPU_TRITON_NOTE}\n"
    text = f"""# Attention backends compared

`{command}`

{setup}.

Step time is the whole optimizer step between device synchronisations, over the steady-state
iterations (after the warm-up steps), as are tokens/s and MFU; peak memory is the most torch
allocated on the GPU. Losses are nats per token; bits/char is the val loss per character
(nanoGPT's character-level Shakespeare reaches 2.12). The last two columns are the largest
distance from the (first) {REFERENCE} run's training loss at every logged iteration and val loss
at every evaluation.
{notes}
| backend | final train loss | final val loss | final val bits/char | step ms (median) | step ms (p10 - p90) | tokens/s | MFU | peak memory (MB) | max abs diff, train loss | max abs diff, val loss |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
""" + "\n".join(comparison_row(run, reference) for run in runs) + "\n"
    profiles = {run.label: read_profile(run.out_dir) for run in trained}
    profiles = {label: profile for label, profile in profiles.items() if profile is not None}
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(text + (profile_table(profiles) if profiles else ""))
    plot_comparison(runs, os.path.join(out, "compare.png"), setup, reference)
    if profiles:
        plot_profiles(profiles, os.path.join(out, "profile.png"), setup)


def busy_ms(profile):
    return sum(ms for category, ms in profile["ms"].items() if category != "idle")


def profile_unit(profiles):
    return "GPU kernel" if all(p["device"] == "cuda" for p in profiles.values()) else "CPU op"


def share_text(profile):
    """Attention's share of the busy time, or "n/a (fused)" where Inductor fused it with other work."""
    attention = profile["ms"]["attention forward"] + profile["ms"]["attention backward"]
    return f"{100 * attention / busy_ms(profile):.0f}%" if attention > 0 else "n/a (fused)"


def profile_table(profiles):
    """compare.md's section on where each profiled run's step goes."""
    rows = [" | ".join([f"| {label}", *(f"{profile['ms'][c]:.2f}" for c in CATEGORIES), f"{profile['step_ms']:.2f}",
                        f"{busy_ms(profile):.2f}", share_text(profile), fmt(profile.get("peak_mem_mb"), ",.0f"),
                        fmt(profile.get("attention_saved_mb"), ",.1f")]) + " |" for label, profile in profiles.items()]
    return f"""
## Where the step goes

torch.profiler over {next(iter(profiles.values()))['steps']} steady steps of each run (training/profiling.py), in ms
per optimizer step of {profile_unit(profiles)} time. Idle: the device ran nothing, waiting for the host. Attention's
share is of busy time (the step less idle); "n/a (fused)" where attention is fused into other
kernels. Attention saved: what attention keeps for backward in one micro-batch (all layers).

| run | {' | '.join(CATEGORIES)} | step (wall) | busy | attention share | peak memory (MB) | attention saved (MB) |
|{' --- |' * (len(CATEGORIES) + 6)}
""" + "\n".join(rows) + "\n"


def plot_profiles(profiles, path, setup):
    """A stacked bar per profiled run: its step's time by category, idle last."""
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    ax = fig.subplots()
    fig.suptitle(textwrap.fill(f"Where the step goes: {setup}", 130), fontsize=9)
    labels = list(profiles)
    bottoms = np.zeros(len(labels))
    for i, category in enumerate(CATEGORIES):
        values = np.array([profiles[label]["ms"][category] for label in labels])
        ax.bar(labels, values, bottom=bottoms, label=category, color="white" if category == "idle" else f"C{i}",
               edgecolor="grey", hatch="//" if category == "idle" else None)
        bottoms += values
    for x, (label, total) in enumerate(zip(labels, bottoms)):
        ax.text(x, total, f"{total:.1f} ms\nattention share {share_text(profiles[label])}",
                ha="center", va="bottom", fontsize=8)
    ax.set(ylabel=f"ms per optimizer step ({profile_unit(profiles)} time; idle: nothing running)",
           ylim=(0, 1.15 * bottoms.max()))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)


def tick_labels(runs):
    """A word a line, so that six labels ("eager compiled", ...) side by side do not run together."""
    return [run.label.replace(" ", "\n") for run in runs]


def plot_comparison(runs, path, setup, reference):
    """Loss curves, their distance from eager's, step time and tokens/s; on a GPU also MFU and
    peak memory, which a CPU has no numbers for."""
    trained = [run for run in runs if run.finished]
    on_cpu = bool(trained) and all(run.config.get("gpu") is None for run in trained)
    fig = Figure(figsize=(12, 9) if on_cpu else (17, 9), layout="constrained")
    axes = fig.subplots(2, 2 if on_cpu else 3).flatten()
    fig.suptitle(f"Attention backends compared: {setup}" + (f"\n{CPU_TRITON_NOTE}" if on_cpu and any(
        run.config["attn"] in TRITON_BACKENDS for run in trained) else ""), fontsize=9)
    plot_losses(axes[0], trained, reference)
    if reference is None:
        no_data(axes[1], f"no {REFERENCE} run to compare with")
    else:
        for run in (run for run in trained if run is not reference):
            pairs = loss_differences(run, reference)  # equal losses would vanish from a log scale: drawn at 1e-9
            axes[1].plot([i for i, _ in pairs], [max(d, 1e-9) for _, d in pairs], color=COLORS.get(run.config["attn"]),
                         label=run.label)
        axes[1].set(yscale="log", title=f"|training loss - {REFERENCE}'s| (floor 1e-9: equal)", xlabel="iteration")
        axes[1].legend(fontsize=7)
    step_times = [[r["step_ms"] for r in steady_records(run)] for run in trained]
    if any(step_times):
        axes[2].boxplot(step_times, tick_labels=tick_labels(trained), whis=(10, 90), showfliers=False)
        axes[2].set(title="steady-state step time (box: quartiles, whiskers: p10-p90)", ylabel="ms")
    else:
        no_data(axes[2], "no steady-state steps (max_iters too small)")
    bar_chart(axes[3], runs, lambda run: median_of(run, "tokens_per_s"), "tokens/s (median)", "tokens/s", "{:,.0f}")
    if not on_cpu:
        gpu = trained[0].config.get("gpu") if trained else None
        bar_chart(axes[4], runs, lambda run: median_of(run, "mfu") and 100 * median_of(run, "mfu"),
                  "MFU (median)", "% of the card's bf16 peak", "{:.1f}%",
                  f"no MFU: training/devices.py has no bf16 peak\nfor the {gpu} to divide by.")
        bar_chart(axes[5], runs, peak_memory, "peak GPU memory", "MB", "{:,.0f}")
        cap_gb = trained[0].config.get("max_memory_gb") if trained else None
        if cap_gb and axes[5].axison:  # the cap as a line, the axis stretched to show it (peak_mem_mb is MiB)
            axes[5].axhline(cap_gb * 1024, color="red", ls=":", label=f"max_memory_gb={cap_gb:g}")
            axes[5].set_ylim(top=max(axes[5].get_ylim()[1], 1.08 * cap_gb * 1024))
            axes[5].legend(fontsize=7)
    fig.savefig(path, dpi=120)


def loss_differences(run, reference):
    """(iteration, |training loss - the reference's|) wherever both logged one."""
    reference_loss = {r["iter"]: r["loss"] for r in reference.records if "loss" in r}
    return [(r["iter"], abs(r["loss"] - reference_loss[r["iter"]])) for r in run.records
            if "loss" in r and r["iter"] in reference_loss]


def plot_losses(ax, trained, reference):
    """Every run's training loss at each iteration and val loss at each evaluation. A backend
    whose curves lie within a pixel of the reference's is not drawn over it (its colour would
    hide); the reference's legend entry names it instead."""
    coincide = coinciding_runs(trained, reference)
    for run in (run for run in trained if run not in coincide):
        same = f" (= {', '.join(other.label for other in coincide)})" if run is reference and coincide else ""
        for key, style in (("loss", dict(alpha=0.5, lw=1)), ("val_loss", dict(marker="o", ls="", ms=5))):
            # Evaluations are points: a line between them would claim values nobody measured.
            records = [r for r in run.records if key in r]
            ax.plot([r["iter"] for r in records], [r[key] for r in records], color=COLORS.get(run.config["attn"]),
                    label=f"{run.label}{same} {'train' if key == 'loss' else 'val'}", **style)
    title = "loss: train every iteration, val at evaluations"
    if coincide:
        title += (f"\n{', '.join(run.label for run in coincide)}:\nwithin a pixel of {reference.label}'s curves, "
                  f"drawn as {reference.label}")
    ax.set(title=title, xlabel="iteration", ylabel="cross-entropy")
    ax.legend(fontsize=7)


def coinciding_runs(runs, reference):
    """The runs (not the reference) whose train and val loss curves stay within about a pixel
    of the reference's at every iteration: 1/500 of the reference's loss range."""
    if reference is None:
        return []
    losses = [r[key] for r in reference.records for key in ("loss", "val_loss") if key in r]
    tolerance = (max(losses) - min(losses)) / 500 if losses else 0.0
    return [run for run in runs if run is not reference and all(
        (difference := max_difference(run, reference, key)) is not None and difference <= tolerance
        for key in ("loss", "val_loss"))]


def bar_chart(ax, runs, value_of, title, unit, label_format, missing=None):
    """One bar per run; a run that ran out of memory or failed gets a label instead of a bar."""
    values = {run.label: value_of(run) for run in runs if run.finished}
    if all(value is None for value in values.values()):
        return no_data(ax, missing or f"{title}: n/a")
    for i, run in enumerate(runs):
        if not run.finished:
            ax.text(i, 0, "out of\nmemory" if run.out_of_memory else "failed", ha="center", va="bottom", color="red",
                    fontsize=8)
        elif values[run.label] is not None:
            ax.bar(i, values[run.label], color=COLORS.get(run.config["attn"]))
            ax.text(i, values[run.label], label_format.format(values[run.label]), ha="center", va="bottom", fontsize=8)
    ax.set(title=title, ylabel=unit, xticks=range(len(runs)), xticklabels=tick_labels(runs))


def no_data(ax, message):
    ax.set_axis_off()
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config, passed_on, train_config = parse_args(argv)
    try:
        if config.from_runs:  # labelled by backend, and by folder where backends repeat
            out_dirs = split_list(config.from_runs)
            backends = [read_run_config(out_dir)["attn"] for out_dir in out_dirs]
            runs = [Run(backend if backends.count(backend) == 1 else f"{backend} ({os.path.basename(out_dir)})",
                        out_dir, read_run_config(out_dir), read_metrics(out_dir))
                    for backend, out_dir in zip(backends, out_dirs)]
            for difference in differing_settings(runs):
                print(f"warning: the runs differ in {difference}; compare.md says so", file=sys.stderr)
        else:  # a backend that fails is marked in compare.md; the others still run
            # (label suffix, extra train.py arguments) for each way every backend trains
            variants = [("", [])] if not config.compile_both else [("", ["--compile=False"]),
                                                                   (" compiled", ["--compile=True"])]
            profile = ["--profile=True"] if config.profile else []
            runs = [train(backend + suffix, os.path.join(config.out, "runs", (backend + suffix).replace(" ", "-")),
                          ["--log_interval=1", f"--eval_interval={max(1, train_config.max_iters // 5)}", *passed_on,
                           *profile, *extra, f"--attn={backend}"],
                          train_config.max_iters)
                    for backend in split_list(config.backends) for suffix, extra in variants]
        write_comparison(runs, config.out, " ".join(["python compare.py", *argv]))
    except KeyboardInterrupt:
        print("compare.py: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    written = ["compare.md", "compare.png"] + (["profile.png"] if config.profile else [])
    print("wrote " + ", ".join(os.path.join(config.out, name) for name in written))
    failed = [run.label for run in runs if run.failure]
    if failed:
        print(f"error: {len(failed)} of {len(runs)} runs failed ({', '.join(failed)}); the others were compared",
              file=sys.stderr)
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
