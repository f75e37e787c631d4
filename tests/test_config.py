"""training/configurator.py and train.py's config checks: bad settings stop the run, naming the key."""
from dataclasses import dataclass

import re
from dataclasses import fields

import pytest

from attention import BACKENDS
from conftest import REPO, run_script
from sample import SampleConfig
from training.configurator import ConfigError, choice, config_files, field_meanings, parse_config
from training.exit_codes import EXIT_BAD_CONFIG, EXIT_ERROR
from training.train_config import TrainConfig, check_config


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


def test_readme_prompt_files_exist():
    prompt_files = re.findall(r"--start=FILE:(\S+)", (REPO / "README.md").read_text())
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


@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
def test_train_rejects_a_head_dim_the_triton_kernels_cannot_take(attn, tmp_path):
    result = run_script("train.py", "configs/tiny.py", f"--attn={attn}", "--n_embd=48", "--n_head=2",
                        f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert (f"attn='{attn}' with n_embd=48 and n_head=2: the head dim n_embd / n_head = 24 must be one of "
            "(16, 32, 64, 128)") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attn", BACKENDS)
def test_the_default_run_passes_every_check_with_every_backend(attn):
    """train.py's defaults are the GPU run of the README: a change to them (its head dim, say)
    must not leave a backend that refuses them."""
    check_config(TrainConfig(attn=attn))


@pytest.mark.parametrize("settings, world_size, message", [
    (dict(compile=True, compile_mode="reduce-overhead"), 1, "compile_mode='reduce-overhead', which captures CUDA graphs"),
    (dict(compile=True, compile_mode="max-autotune"), 1, "compile_mode='max-autotune', which captures CUDA graphs"),
    (dict(gradient_accumulation_steps=2), 2, "under torchrun with 2 processes"),
    (dict(profile=True), 1, "with profile=True"),
])
def test_cuda_graph_refuses_what_it_cannot_capture(settings, world_size, message):
    check_config(TrainConfig(**settings), world_size=world_size)  # fine without the graph
    with pytest.raises(ConfigError, match=r"cuda_graph=True: expected False .*" + re.escape(message)):
        check_config(TrainConfig(cuda_graph=True, **settings), world_size=world_size)


def test_cuda_graph_takes_the_compile_modes_without_graphs_of_their_own():
    for mode in ("default", "max-autotune-no-cudagraphs"):
        check_config(TrainConfig(cuda_graph=True, compile=True, compile_mode=mode))


def test_train_refuses_a_cuda_graph_on_the_cpu(tmp_path):
    result = run_script("train.py", "configs/tiny.py", "--cuda_graph=True", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_ERROR
    assert "cuda_graph=True needs a CUDA device; this run is on cpu" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("seed", [-5, 2**32])
def test_train_rejects_a_seed_outside_numpys_range(seed, tmp_path):
    result = run_script("train.py", "configs/tiny.py", f"--seed={seed}", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == EXIT_BAD_CONFIG
    assert f"seed={seed}: expected an int in [0, 4294967295]" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_seed_range_leaves_room_for_every_process():
    """Process r seeds with seed + r: with 4 processes the largest seed is 2**32 - 4."""
    from training.train_config import TrainConfig, check_config
    check_config(TrainConfig(seed=2**32 - 4, gradient_accumulation_steps=4), world_size=4)
    with pytest.raises(ConfigError, match=r"seed=4294967293: expected an int in \[0, 4294967292\]"):
        check_config(TrainConfig(seed=2**32 - 3, gradient_accumulation_steps=4), world_size=4)
