"""What a training run writes to its out_dir besides ckpt.pt, and reading it back.

    config.json    the run's settings and what they resolved to (device, dtype, processes,
                   parameter count, tokens per iteration), as logged to wandb
    metrics.jsonl  one JSON object a line. Log records: iter, loss, lr, step_ms,
                   tokens_per_s, mfu, peak_mem_mb, warmup. Eval records: iter, train_loss,
                   val_loss (nats per token), val_bpc (val bits per character).

train.py writes both; compare.py reads them to compare runs.
"""
import json
import math
import os

from training.atomic import write_atomically

CONFIG_NAME = "config.json"
METRICS_NAME = "metrics.jsonl"


def write_run_config(out_dir, run_config):
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(run_config, f, indent=2)
        f.write("\n")


def read_run_config(out_dir):
    with open(os.path.join(out_dir, CONFIG_NAME)) as f:
        return json.load(f)


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl in order, skipping a line cut short by a kill."""
    records = []
    with open(os.path.join(out_dir, METRICS_NAME)) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def reset_metrics(out_dir, keep_through_iter):
    """Start out_dir/metrics.jsonl for this run. A fresh run (keep_through_iter None) starts
    it empty. A resumed run keeps the records up to the checkpoint's iteration and drops the
    rest (the interrupted run may have logged past its last checkpoint, or been killed
    mid-line), so the file reads as one run."""
    path = os.path.join(out_dir, METRICS_NAME)
    kept = []
    if keep_through_iter is not None and os.path.exists(path):
        kept = [record for record in read_metrics(out_dir) if record.get("iter", math.inf) <= keep_through_iter]
    with write_atomically(path) as f:
        for record in kept:
            f.write(json.dumps(record) + "\n")


def append_metrics(out_dir, record):
    with open(os.path.join(out_dir, METRICS_NAME), "a") as f:
        f.write(json.dumps(record) + "\n")
