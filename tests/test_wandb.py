"""train.py --wandb_log=True with the real wandb package in offline mode, and on a machine
without wandb (a shim on PYTHONPATH makes `import wandb` fail)."""
import json
import os
import struct
import subprocess

from conftest import REPO, run_script, script_command
from training.run_files import read_metrics

NO_WANDB = REPO / "tests" / "shims" / "no_wandb"
LOGGED_KEYS = {"loss", "lr", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb", "warmup", "train_loss", "val_loss"}


def wandb_records(path):
    """The protobuf Records of a wandb run file (run-<id>.wandb). Its format is LevelDB's log:
    a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length,
    type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    block = 32 * 1024
    data = path.read_bytes()
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_offline_wandb_run_folder_holds_the_config_and_every_logged_key(tiny_args, tmp_path):
    # wandb's own settings and caches go to the test's folder, not the home directory.
    env = dict(os.environ, WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    result = run_script("train.py", *tiny_args, "--max_iters=4", "--eval_interval=4", "--log_interval=1",
                        "--attn=sdpa", "--wandb_log=True", env=env)
    assert result.returncode == 0, result.stderr
    run_files = list((tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    records = list(wandb_records(run_files[0]))

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "nanoFA2" and run.display_name == "sdpa-tiny"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["attn"] == "sdpa" and config["block_size"] == 64 and config["world_size"] == 1

    history = {}  # step -> {key: value}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    assert sorted(history) == [0, 1, 2, 3, 4]
    assert LOGGED_KEYS <= set().union(*history.values())
    for record in read_metrics(tmp_path / "out"):  # wandb got what metrics.jsonl got
        assert {key: history[record["iter"]][key] for key in record if key != "iter"} == \
            {key: value for key, value in record.items() if key != "iter"}


def test_a_resumed_run_continues_its_wandb_run(tiny_args, tmp_path):
    """The checkpoint keeps the wandb run's id, and --init_from=resume logs to the same run
    (offline: a second run folder with the same id, which `wandb sync` uploads into that run)."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    common = [*tiny_args, "--eval_interval=2", "--log_interval=1", "--attn=sdpa", "--wandb_log=True"]
    first = run_script("train.py", *common, "--max_iters=2", env=env)
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", *common, "--max_iters=4", "--init_from=resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    folders = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    run_ids = {folder.name.rsplit("-", 1)[1] for folder in folders}
    assert len(run_ids) == 1, folders
    steps = {json.loads(item.value_json) for record in wandb_records(next(folders[1].glob("run-*.wandb")))
             if record.WhichOneof("record_type") == "history"
             for item in record.history.item if ("/".join(item.nested_key) or item.key) == "_step"}
    assert steps == {3, 4}  # the resumed run logs where the first one stopped


def test_without_wandb_training_goes_on_with_local_metrics(tiny_args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(NO_WANDB), os.environ.get("PYTHONPATH", "")]))
    result = run_script("train.py", *tiny_args, "--max_iters=4", "--eval_interval=4", "--log_interval=2",
                        "--wandb_log=True", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("wandb_log=True but wandb cannot be imported (pip install wandb)") == 1
    assert "Traceback" not in result.stderr
    records = read_metrics(tmp_path / "out")
    assert [r["iter"] for r in records if "loss" in r] == [2, 3, 4]
    assert [r["iter"] for r in records if "val_loss" in r] == [0, 4]
    assert not (tmp_path / "out" / "wandb").exists()


def test_online_without_a_login_is_one_line_exit_2_before_any_training(tiny_args, tmp_path):
    # No WANDB_MODE (online), no API key: a home folder without ~/.netrc, and wandb settings of its own.
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "home" / ".netrc"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    result = subprocess.run(script_command("train.py", *tiny_args, "--max_iters=2", "--wandb_log=True"), cwd=REPO,
                            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: wandb_log=True but wandb cannot start a run")
    assert "`wandb login`" in lines[0] and "WANDB_MODE=offline" in lines[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing trained or logged
