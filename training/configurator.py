"""Typed configuration for the scripts: defaults, then config files, then --key=value.

Each script declares its settings once, as a dataclass of typed defaults:

    @dataclass
    class TrainConfig:
        max_iters: int = 5000
        attn: str = choice("eager", attention.BACKENDS)

    config = parse_config(TrainConfig)      # reads sys.argv[1:]

and is run as

    python train.py configs/tiny.py --max_iters=50 --attn=sdpa

Positional arguments are config files: Python files whose top-level assignments set keys
(applied in order). `--key=value` (or `--key value`) overrides come after all files,
whatever their position.
Every value is checked against the field's type and, for `choice` fields, its allowed
values, so a typo stops the run at once instead of training with a default. Errors exit
with status 2 (the usual status for bad usage) and a message naming the key; `--help`
lists every key with its type, default, choices and meaning. A key's meaning is the comment
at the end of its line in the dataclass, read from the source, so it is written once.
"""
import dataclasses
import difflib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types

from training.exit_codes import EXIT_BAD_CONFIG


class ConfigError(ValueError):
    pass


def choice(default, choices):
    """A dataclass field whose value must be one of `choices`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def parse_config(config_class, argv=None, check=None, usage=""):
    """Build a `config_class` from argv (default sys.argv[1:]); exit 2 on a bad key or value.

    `check(config)` may raise ConfigError for rules that involve several keys
    (e.g. n_embd divisible by n_head); it is reported the same way. `usage` (the script's
    docstring) is printed by --help above the keys.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(f"{usage.strip()}\n\n{describe(config_class)}" if usage else describe(config_class))
        sys.exit(0)
    try:
        config = build_config(config_class, argv)
        if check is not None:
            check(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    return config


def join_overrides(argv):
    """The arguments with each `--key value` pair joined into `--key=value`, as argparse users
    expect; a `--key` with no value after it is left alone (and rejected by build_config)."""
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
    overrides = [arg for arg in join_overrides(argv) if arg.startswith("--")]
    for path in config_files(argv):
        for key, value in read_config_file(path).items():
            where = f"{key} (set in {path})"
            field = lookup_field(fields, key, where)
            values[key] = check_value(field, value, where)
    for arg in overrides:
        key, sep, text = arg[2:].partition("=")
        if not sep:
            raise ConfigError(f"{arg!r}: overrides are written --key=value (or --key value)")
        field = lookup_field(fields, key, f"--{key}")
        values[key] = check_value(field, parse_text(field, text, f"--{key}"), f"--{key}")
    return config_class(**values)


def read_config_file(path):
    """The top-level names a config file assigns (modules and _private names skipped)."""
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:
        raise ConfigError(f"config file {path!r} failed to run: {type(e).__name__}: {e}") from None
    return {key: value for key, value in namespace.items()
            if not key.startswith("_") and not isinstance(value, types.ModuleType)}


def lookup_field(fields, key, where):
    if key in fields:
        return fields[key]
    close = difflib.get_close_matches(key, fields, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown key {where}{hint}; valid keys: {', '.join(fields)}")


def parse_text(field, text, where):
    """The value of a command-line string for a field of type bool, int, float or str."""
    if field.type is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"{where}={text!r}: expected a bool (True or False)")
    if field.type in (int, float):
        try:
            return field.type(text)
        except ValueError:
            raise ConfigError(f"{where}={text!r}: expected {type_name(field.type)}") from None
    return text


def check_value(field, value, where):
    """Type-check `value` for `field` (an int is accepted for a float) and its choices."""
    expected = field.type
    if expected is float and type(value) is int:
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(f"{where}={value!r}: expected {type_name(expected)}, got {type(value).__name__}")
    choices = field.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}={value!r}: valid choices are {', '.join(map(str, choices))}")
    return value


def type_name(t):
    return {bool: "a bool", int: "an int", float: "a float", str: "a string"}.get(t, str(t))


def field_meanings(config_class):
    """{key: its one-line meaning}: the comment that ends the key's line in the class source."""
    source = textwrap.dedent(inspect.getsource(config_class))
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    meanings = {}
    for number, line in enumerate(source.splitlines(), start=1):
        match = re.match(r"\s+(\w+)\s*:", line)
        if match and number in comments:
            meanings[match[1]] = comments[number]
    return meanings


def describe(config_class):
    """Every key with its default, type, choices and meaning: what --help prints."""
    meanings = field_meanings(config_class)
    lines = [f"{config_class.__name__} keys (set in config files, or as --key=value or --key value):"]
    for field in dataclasses.fields(config_class):
        choices = field.metadata.get("choices")
        extra = f", one of {', '.join(map(str, choices))}" if choices else ""
        lines.append(f"  --{field.name}={field.default!r}  ({field.type.__name__}{extra})")
        if field.name in meanings:
            lines.append(f"      {meanings[field.name]}")
    return "\n".join(lines)
