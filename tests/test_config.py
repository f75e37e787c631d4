"""training/config.py and the scripts' config checks: bad settings stop the run, naming the key,
before torch loads and before anything is made."""
import re
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest
import torch

from attention import BACKENDS, TRITON_BACKENDS
from conftest import REPO, run_script
from model import GPTConfig
from training.config import (EXIT_BAD_CONFIG, ConfigError, SampleConfig, TrainConfig, check_config, choice,
                             config_files, field_meanings, parse_config, resolve_switches)


@dataclass
class ExampleConfig:
    steps: int = 10
    rate: float = 0.5
    name: str = "run"
    verbose: bool = False
    mode: str = choice("fast", ("fast", "slow"))


def parse_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(ExampleConfig, argv)
    assert exit_info.value.code == EXIT_BAD_CONFIG
    return capsys.readouterr().err


def test_defaults_then_files_then_overrides(tmp_path):
    config_file = tmp_path / "c.py"
    config_file.write_text("steps = 20\nrate = 1\nmode = 'slow'\n")
    config = parse_config(ExampleConfig, ["--steps=30", str(config_file), "--verbose=true"])
    assert config == ExampleConfig(steps=30, rate=1.0, name="run", verbose=True, mode="slow")


def test_unknown_key_names_it_and_the_valid_keys(capsys):
    message = parse_error(["--step=3"], capsys)
    assert "--step" in message and "did you mean 'steps'" in message
    assert all(key in message for key in ("steps", "rate", "name", "verbose", "mode"))


def test_wrong_type_names_the_key_and_the_type(capsys):
    assert "--steps='1.5': expected an int" in parse_error(["--steps=1.5"], capsys)
    assert "--verbose='maybe': expected a bool" in parse_error(["--verbose=maybe"], capsys)
    assert "--rate='fast': expected a float" in parse_error(["--rate=fast"], capsys)


def test_value_outside_the_choices_lists_them(capsys):
    assert "--mode='medium': valid choices are fast, slow" in parse_error(["--mode=medium"], capsys)


def test_config_file_errors_name_the_file_and_key(tmp_path, capsys):
    bad_key = tmp_path / "bad_key.py"
    bad_key.write_text("stepz = 3\n")
    assert f"stepz (set in {bad_key})" in parse_error([str(bad_key)], capsys)
    bad_type = tmp_path / "bad_type.py"
    bad_type.write_text("steps = '3'\n")
    assert "expected an int, got str" in parse_error([str(bad_type)], capsys)
    assert "cannot read config file" in parse_error([str(tmp_path / "missing.py")], capsys)


def test_override_without_value_is_rejected(capsys):
    assert "--key=value" in parse_error(["--verbose"], capsys)


def test_space_form_overrides_are_read_as_key_value(tmp_path):
    config_file = tmp_path / "c.py"
    config_file.write_text("steps = 20\n")
    argv = [str(config_file), "--steps", "30", "--name", "x", "--rate=2"]
    assert parse_config(ExampleConfig, argv) == ExampleConfig(steps=30, rate=2.0, name="x")
    assert config_files(argv) == [str(config_file)]


@pytest.mark.parametrize("script, config_class", [("train.py", TrainConfig), ("sample.py", SampleConfig)])
def test_help_gives_every_key_its_meaning_the_exit_codes_and_the_paths(script, config_class):
    meanings = field_meanings(config_class)
    assert [f.name for f in fields(config_class) if not meanings.get(f.name)] == []  # every key has a comment
    result = run_script(script, "--help")
    assert result.returncode == 0
    for field in fields(config_class):
        assert f"--{field.name}=" in result.stdout and meanings[field.name] in result.stdout
    assert "Exit status" in result.stdout and "relative to the current" in result.stdout
    if script == "sample.py":
        assert "FILE:path" in result.stdout


def test_default_data_dir_is_in_the_repo_wherever_train_runs_from():
    assert TrainConfig().data_dir == str(REPO / "data" / "shakespeare")


def test_the_prompt_files_the_docs_name_exist():
    texts = [(REPO / "sample.py").read_text(), (REPO / "README.md").read_text(),
             *(path.read_text() for path in (REPO / "docs").glob("*.md"))]
    prompt_files = [path for text in texts for path in re.findall(r"--start=FILE:([\w./-]+\.\w+)", text)]
    assert prompt_files and all((REPO / path).is_file() for path in prompt_files)


def test_train_rejects_a_bad_backend_listing_every_valid_one(tmp_path):
    result = run_script("train.py", "configs/tiny.py", "--attn=flash", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert "--attn='flash'" in result.stderr
    assert all(name in result.stderr for name in BACKENDS)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_train_rejects_values_out_of_range(tmp_path):
    result = run_script("train.py", "configs/tiny.py", "--n_head=3", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert "n_embd=64: expected a positive multiple of n_head=3" in result.stderr


@pytest.mark.parametrize("script, args", [("train.py", ["configs/tiny.py"]), ("sample.py", ["--init_from=random"])])
def test_a_window_past_int64_is_a_bad_config_in_one_line(script, args, tmp_path):
    """Attention's window sides are int64: a 20-digit window was a traceback from inside the model."""
    result = run_script(script, *args, "--window=123456789012345678901", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.strip() == ("config error: window=123456789012345678901: expected -1 (every key before the "
                                     "query) or an int >= 0 below 2**63")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
@pytest.mark.parametrize("n_embd, head_dim", [(36, 18), (528, 264)], ids=["not a multiple of 8", "over 256"])
def test_train_rejects_a_head_dim_the_triton_kernels_cannot_take(attn, n_embd, head_dim, tmp_path):
    result = run_script("train.py", "configs/tiny.py", f"--attn={attn}", f"--n_embd={n_embd}", "--n_head=2",
                        f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert (f"attn='{attn}' with n_embd={n_embd} and n_head=2: the head dim n_embd / n_head = {head_dim} must be a "
            "multiple of 8, at most 256") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attn", BACKENDS)
def test_the_default_run_passes_every_check_with_every_backend(attn):
    """train.py's defaults are the GPU run of the README: a change to them (its head dim, say)
    must not leave a backend that refuses them."""
    check_config(TrainConfig(attn=attn))


@pytest.mark.parametrize("settings, world_size, message", [
    (dict(compile=True, compile_mode="reduce-overhead"), 1, "compile_mode='reduce-overhead', which captures CUDA graphs"),
    (dict(compile_mode="max-autotune"), 1, "compile_mode='max-autotune', which captures CUDA graphs"),
    (dict(gradient_accumulation_steps=2), 2, "under torchrun with 2 processes"),
    (dict(profile=True), 1, "with profile=True"),
])
def test_an_explicit_cuda_graph_refuses_what_it_cannot_capture_and_the_default_yields(settings, world_size, message):
    config = TrainConfig(**settings)
    check_config(config, world_size=world_size)  # the default graph yields quietly ...
    assert resolve_switches(config, "cuda", world_size).cuda_graph is False
    with pytest.raises(ConfigError, match=r"cuda_graph=True: expected False or auto .*" + re.escape(message)):
        check_config(TrainConfig(cuda_graph=True, **settings), world_size=world_size)  # ... an explicit one is refused


def test_the_default_run_compiles_and_replays_a_cuda_graph_on_a_gpu_and_neither_on_the_cpu():
    assert (TrainConfig().compile, TrainConfig().cuda_graph) == ("auto", "auto")
    on_gpu, on_cpu = resolve_switches(TrainConfig(), "cuda"), resolve_switches(TrainConfig(), "cpu")
    assert (on_gpu.compile, on_gpu.cuda_graph) == (True, True)
    assert (on_cpu.compile, on_cpu.cuda_graph) == (False, False)
    told = resolve_switches(TrainConfig(compile=False, cuda_graph=False), "cuda")
    assert (told.compile, told.cuda_graph) == (False, False)
    assert resolve_switches(TrainConfig(compile=True), "cpu").compile is True


@pytest.mark.parametrize("bf16", [True, False])
def test_the_gpu_runs_in_bfloat16_where_the_card_has_it_else_float16(bf16, monkeypatch):
    # The CPU twin of test_trains_on_the_gpu_with_mixed_precision's dtype, the card mocked.
    from training.devices import pick_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    cuda = torch.device("cuda")
    assert pick_dtype("auto", cuda) == (torch.bfloat16 if bf16 else torch.float16)
    assert pick_dtype("float16", cuda) == torch.float16 and pick_dtype("auto", torch.device("cpu")) == torch.float32
    if not bf16:
        with pytest.raises(ConfigError, match="dtype='bfloat16' is not supported by this GPU; use float16 or auto"):
            pick_dtype("bfloat16", cuda)


def test_cuda_graph_takes_the_compile_modes_without_graphs_of_their_own():
    for mode in ("default", "max-autotune-no-cudagraphs"):
        check_config(TrainConfig(cuda_graph=True, compile=True, compile_mode=mode))


def test_switches_take_auto_true_or_false_on_the_command_line_and_in_files(tmp_path, capsys):
    (tmp_path / "c.py").write_text("compile = True\n")
    assert parse_config(TrainConfig, [str(tmp_path / "c.py"), "--cuda_graph=false"]).cuda_graph is False
    assert parse_config(TrainConfig, [str(tmp_path / "c.py")]).compile is True
    assert parse_config(TrainConfig, ["--compile=auto"]).compile == "auto"
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--compile=maybe"])
    assert "--compile='maybe': valid choices are auto, True, False" in capsys.readouterr().err
    (tmp_path / "one.py").write_text("compile = 1\n")  # 1 == True, but not a bool
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, [str(tmp_path / "one.py")])


def test_help_says_the_gpu_compiles_and_replays_a_graph_by_default():
    help_text = run_script("train.py", "--help").stdout
    assert "--compile='auto'  (one of auto, True, False)" in help_text
    assert help_text.count("auto: on where CUDA is the device") == 2


@pytest.mark.parametrize("args, message", [
    (["--cuda_graph=True"], "cuda_graph=True: expected False or auto with device='cpu'"),
    (["--cuda_graph=True", "--device=auto"], "cuda_graph=True needs a CUDA device; this run is on cpu"),
    (["--dtype=float16"], "dtype='float16': expected float32 or bfloat16 on the CPU"),
    (["--max_memory_gb=12"], "max_memory_gb=12.0: expected 0 with device='cpu'"),
    (["--device=cuda"], "device='cuda' but torch sees no CUDA GPU"),
    (["--block_size=400000"], "block_size=400000 needs at least 400001 tokens per sample"),
], ids=["cuda_graph", "cuda_graph auto device", "float16", "memory cap", "no GPU", "block_size"])
def test_a_setting_the_machine_or_data_cannot_run_exits_2_and_makes_nothing(args, message, data_dir, tmp_path):
    if "--device=" in " ".join(args) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", *args)
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.startswith(f"config error: {message}") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [-5, 2**32])
def test_train_rejects_a_seed_outside_numpys_range(seed, tmp_path):
    result = run_script("train.py", "configs/tiny.py", f"--seed={seed}", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert f"seed={seed}: expected an int in [0, 4294967295]" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_seed_range_leaves_room_for_every_process():
    """Process r seeds with seed + r: with 4 processes the largest seed is 2**32 - 4."""
    check_config(TrainConfig(seed=2**32 - 4, gradient_accumulation_steps=4), world_size=4)
    with pytest.raises(ConfigError, match=r"seed=4294967293: expected an int in \[0, 4294967292\]"):
        check_config(TrainConfig(seed=2**32 - 3, gradient_accumulation_steps=4), world_size=4)


def test_the_config_reads_attentions_backends_without_loading_torch():
    probe = "import sys, training.config as c; print(*c.BACKENDS, '|', *c.TRITON_BACKENDS, '|', 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == [*BACKENDS, "|", *TRITON_BACKENDS, "|", "False"], result.stderr


def test_the_default_runs_model_is_gpt_configs_defaults():
    assert TrainConfig().model_config(GPTConfig().vocab_size) == GPTConfig()


def exit_before_torch(script, *args):
    """(exit status, stderr, whether torch was imported by then): the script run as a user runs
    it, up to its sys.exit."""
    probe = (f"import runpy, sys; sys.argv = [{script!r}, *{list(map(str, args))!r}]\n"
             f"try: runpy.run_path({script!r}, run_name='__main__')\n"
             "except SystemExit as e: print(e.code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    status, torch_loaded = result.stdout.split()[-2:]
    return int(status), result.stderr, torch_loaded == "True"


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
@pytest.mark.parametrize("args, status", [(["--help"], 0), (["--bogus=1"], EXIT_BAD_CONFIG)], ids=["help", "bad key"])
def test_help_and_a_bad_key_answer_before_torch_is_imported(script, args, status):
    assert exit_before_torch(script, *args)[::2] == (status, False)


@pytest.mark.parametrize("key", ["out_dir", "data_dir"])
def test_an_empty_folder_path_is_a_bad_config_before_torch_loads(key, tmp_path):
    # It passed the path checks: out_dir='' met os.makedirs('') (a FileNotFoundError traceback),
    # data_dir='' failed in prepare.py with exit 1.
    paths = {"out_dir": tmp_path / "out", "data_dir": tmp_path / "data", key: ""}
    status, stderr, torch_loaded = exit_before_torch("train.py", "configs/tiny.py",
                                                     *(f"--{name}={path}" for name, path in paths.items()))
    assert (status, torch_loaded) == (EXIT_BAD_CONFIG, False)
    assert stderr == f"config error: {key}='': expected a folder's path (made if missing), got an empty one; " \
                     "'.' is the current folder\n"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["configs/tiny.py", "--max_iters=1", "--out="], "out='': expected a folder's path (made if missing), got an "
                                                      "empty one"),
    (["--from_runs=,"], "from_runs=',': expected the out_dirs of train.py runs, comma-separated"),
], ids=["out", "from_runs"])
def test_compare_refuses_an_empty_path_before_any_run(args, message, tmp_path, capsys):
    # compare.py --out= trained every backend, then failed to make the folder; --from_runs=,
    # compared no run and exited 0. Its arguments are the first thing it reads.
    from compare import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--out={tmp_path / 'report'}", *args])
    assert exit_info.value.code == EXIT_BAD_CONFIG
    assert capsys.readouterr().err.startswith(f"config error: {message}")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("body, what", [
    ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
    ("import sys\nsys.exit(7)\n", "SystemExit: 7"),
], ids=["KeyboardInterrupt", "exit 0", "exit 7"])
def test_a_config_file_that_stops_or_exits_is_a_bad_config(body, what, tmp_path):
    (tmp_path / "c.py").write_text(body)
    result = run_script("train.py", tmp_path / "c.py", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.startswith(f"config error: config file '{tmp_path / 'c.py'}' failed to run: {what}")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_file_that_is_not_utf8_is_a_bad_config(tmp_path):
    (tmp_path / "c.py").write_bytes(b"max_iters = 3  # \xff\xfe\n")
    result = run_script("train.py", tmp_path / "c.py", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.startswith(f"config error: cannot read config file '{tmp_path / 'c.py'}': 'utf-8' codec")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_data_dir_that_is_a_file_or_under_one_is_a_bad_config(where, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    data_dir = tmp_path / "file" if where == "a file" else tmp_path / "file" / "data"
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    expected = "is a file; expected a folder" if where == "a file" else f"cannot write there (Not a directory: {tmp_path / 'file'} is a file)"
    assert result.stderr.startswith(f"config error: data_dir='{data_dir}'") and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_an_unwritable_unprepared_data_dir_is_a_bad_config(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    (tmp_path / "read-only").mkdir(mode=0o500)
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={tmp_path / 'read-only'}",
                        f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert "cannot write there (Permission denied" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["ckpt.pt", "resume.pt", "metrics.jsonl", "config.json"])
@pytest.mark.parametrize("init_from", ["scratch", "resume"])
def test_a_run_file_that_is_a_folder_is_a_bad_config(name, init_from, data_dir, tmp_path):
    (tmp_path / "out" / name).mkdir(parents=True)
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}",
                        f"--init_from={init_from}", "--overwrite=True")
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.startswith(f"config error: {tmp_path / 'out' / name} is not a file (a folder?)")
    assert len(result.stderr.strip().splitlines()) == 1
