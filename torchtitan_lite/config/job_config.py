"""Typed run configuration, derived from the section dataclasses of sections.py (where an option is written once):
TOML loading, `--section.key` overrides, `--help`, unknown-key errors, type, choice and range checks. Precedence: command line > TOML file
(`--job.config_file`) > defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from typing import Any, NamedTuple

try:
    import tomllib as tomli  # Python >= 3.11
except ImportError:
    import tomli

from torchtitan_lite.config.paths import absolute, resolve_typed_paths
from torchtitan_lite.config.rules import Rule
from torchtitan_lite.config.sections import ConfigError, JobConfig


class _Opt(NamedTuple):
    key: str  # "section.key"
    section: str
    name: str
    type: type  # str, int, float, bool, list (of strings) or dict
    optional: bool  # None allowed (Optional[...])
    default: Any
    help: str
    choices: tuple[str, ...]
    rule: Rule | None  # None only for strings and bools: tests/test_config.py holds every number to a rule
    path: str  # paths.ONE or LIST: names files; relative on the command line, it is the caller's (paths.py)


_KIND = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
         list: "a list of strings", dict: "a table of names to numbers"}  # dict: TOML only, in a list's tables


def _options(prefix: str, cls: type) -> tuple[dict[str, _Opt], dict[str, tuple[type, dict[str, _Opt]]]]:
    """The options of dataclass `cls` as `prefix.name`, and its lists of tables (list[SomeDataclass] fields, TOML's
    [[prefix.name]]) with their own options, keyed `prefix.name.field`."""
    options, tables = {}, {}
    # get_type_hints, not field.type: under `from __future__ import annotations` the latter is just a string.
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}.{f.name}"
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            tables[key] = (args[0], _options(key, args[0])[0])
            continue
        base = typing.get_origin(tp) if typing.get_origin(tp) in (dict, list) else next(
            (a for a in args if a is not type(None)), tp)
        assert base in _KIND and (base is not list or (args == (str,) and not f.metadata["choices"])), \
            f"{key}: parsing {tp} is not implemented"
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        options[key] = _Opt(key, prefix, f.name, base, type(None) in args, default,
                            *(f.metadata[k] for k in ("help", "choices", "rule", "path")))
    return options, tables


def _collect() -> tuple[dict[str, type], dict[str, _Opt], dict[str, tuple[type, dict[str, _Opt]]]]:
    sections = typing.get_type_hints(JobConfig)
    options, tables = {}, {}
    for sec, cls in sections.items():
        found, lists = _options(sec, cls)
        options.update(found)
        tables.update(lists)
    return sections, options, tables


# The one table every loader and checker below walks; TABLES: the lists of tables ([[mixture.sources]]), each item
# class with its options, which `--section.key` cannot set.
SECTIONS, OPTIONS, TABLES = _collect()
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    """"; did you mean X?" for the candidates close to a misspelt `name`, or "". Options are its first use; a choice
    the config cannot list itself (model.name, models/registry.py) is its other."""
    # Also catch another case ("8b" -> "8B") and a bare key given without its section ("steps" -> "training.steps").
    close = ([c for c in candidates if c.lower() == name.lower()] or difflib.get_close_matches(name, candidates, n=3)
             or [c for c in candidates if c.endswith("." + name)])
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""


def _from_string(o: _Opt, text: str) -> Any:
    """Converts command-line text to the option's type."""
    try:
        if o.optional and text.lower() == "none":
            return None
        if o.type is list:  # the command line's form of a TOML array: NAME,NAME
            return [word.strip() for word in text.split(",") if word.strip()]
        if o.type is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        return o.type(text)  # int("1.5") raises, float("3") is fine
    except ValueError:
        kind = _KIND[o.type] + (" or none" if o.optional else "")
        raise ConfigError(f"--{o.key} expects {kind} (got {text!r})") from None


def _coerce(o: _Opt, value: Any, where: str = "") -> Any:
    """Checks a TOML (or programmatically set) value's type; ints are accepted for floats."""
    if value is None and o.optional:
        return None
    if o.type is float and type(value) is int:
        return float(value)
    if o.type is dict and isinstance(value, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    if o.type is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if o.type is not list and isinstance(value, o.type) and not (o.type is int and isinstance(value, bool)):
        return value  # (bool is an int subclass)
    kind = _KIND[o.type] + (" (leave it out for none)" if o.optional else "")
    raise ConfigError(f"{o.key}{where} must be {kind} (got {type(value).__name__} {value!r})")


def _get(cfg: JobConfig, o: _Opt) -> Any:
    return getattr(getattr(cfg, o.section), o.name)


def _set(cfg: JobConfig, o: _Opt, value: Any) -> None:
    setattr(getattr(cfg, o.section), o.name, value)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (check --job.config_file)") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    for sec, table in data.items():
        if sec not in SECTIONS:
            raise ConfigError(f"unknown section [{sec}] in {source}{did_you_mean(sec, [*SECTIONS, *OPTIONS])}")
        if not isinstance(table, dict):
            raise ConfigError(f"{sec} in {source} must be a table: write [{sec}] and its keys below it")
        for name, value in table.items():
            key = f"{sec}.{name}"
            if key in TABLES:
                setattr(getattr(cfg, sec), name, _tables(key, value, source))
            elif (o := OPTIONS.get(key)) is not None:
                _set(cfg, o, _coerce(o, value, f" in {source}"))
            else:
                raise ConfigError(f"unknown key {key} in {source}{did_you_mean(key, [*OPTIONS, *TABLES])}")


def _tables(key: str, value: Any, source: str) -> list[Any]:
    """A TOML list of tables ([[key]] blocks) as a list of its item dataclass."""
    cls, options = TABLES[key]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{key} in {source} must be a list of tables: write [[{key}]] and its keys below it")
    items = []
    for i, table in enumerate(value):
        item = cls()
        for name, v in table.items():
            if (o := options.get(f"{key}.{name}")) is None:
                raise ConfigError(f"unknown key {name} in [[{key}]] number {i + 1} in {source}"
                                  f"{did_you_mean(name, [o.name for o in options.values()])}")
            setattr(item, name, _coerce(o, v, f" (number {i + 1}) in {source}"))
        items.append(item)
    return items


def _parse_cli(argv: list[str]) -> list[tuple[_Opt, Any]]:
    """Turns argv into ordered (option, typed value) pairs; the accepted forms are listed in help_text()."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value (see --help)")
        name, eq, text = arg[2:].partition("=")
        negated = name.startswith("no-")
        o = OPTIONS.get(name[3:] if negated else name)
        if name in TABLES or (o and o.type is dict):
            raise ConfigError(f"--{name} is set in the TOML file only ([[{name}]] tables; docs/configuration.md)")
        if o is None:
            raise ConfigError(f"unknown option --{name}{did_you_mean(name, list(OPTIONS), '--')}")
        if negated:
            if o.type is not bool or eq:
                raise ConfigError(f"--{name}: the --no- form only exists for boolean options and takes no value")
            out.append((o, False))
            continue
        if not eq:
            # A bool flag takes the next word only if it reads as a bool, so `--compile.enable --other ...` works.
            if o.type is bool and (i == len(argv) or argv[i].lower() not in _TRUE + _FALSE):
                out.append((o, True))
                continue
            if i == len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{name} is missing its value: write --{name} VALUE or --{name}=VALUE")
            text = argv[i]
            i += 1
        out.append((o, _from_string(o, text)))
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Builds the run's config from argv (like sys.argv[1:]): defaults, then the TOML file, then CLI overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        sys.exit(0)
    overrides = _parse_cli(argv)  # parsed first: a typo should fail before any file is read
    cfg = JobConfig()
    path = next((v for o, v in reversed(overrides) if o.key == "job.config_file"), "")
    if path:
        _apply_toml(cfg, _read_toml(absolute(path)), path)
    for o, value in overrides:
        _set(cfg, o, value)
    resolve_typed_paths(cfg, {o for o, _ in overrides if o.path})  # the TOML's own keep resolving as they did
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Raises ConfigError on a wrong type, a value outside its choices, or an impossible value."""
    for o in OPTIONS.values():
        _check(o, _get(cfg, o))
    for key, (_, options) in TABLES.items():
        for i, item in enumerate(_get_table(cfg, key)):
            for o in options.values():
                _check(o, getattr(item, o.name), f" (number {i + 1})")


def _check(o: _Opt, value: Any, where: str = "") -> None:
    _coerce(o, value, where)  # catches configs built in code, which skipped the TOML/CLI checks
    if o.choices and value not in o.choices:
        raise ConfigError(f"{o.key}{where} must be one of {', '.join(o.choices)} (got {value!r})"
                          f"{did_you_mean(str(value), list(o.choices))}")
    if o.rule and value is not None and not o.rule.ok(value):
        raise ConfigError(f"{o.key}{where} must be {_allowed(o)} (got {value!r})")


def _get_table(cfg: JobConfig, key: str) -> list[Any]:
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


def _allowed(o: _Opt) -> str:
    return ("none or " if o.optional else "") + o.rule.text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON string escapes are a subset of TOML's, except that TOML also bans DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; JSON-quoted keys are TOML's quoted keys
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)  # repr round-trips floats exactly (8e-4 -> 0.0008), and TOML reads inf/nan/1e-08


def to_toml(cfg: JobConfig) -> str:
    """The fully resolved config as TOML; None values are left out (TOML has no null) and reload as None."""
    lines = ["# Fully resolved torchtitan_lite config: loading this file alone reproduces the run's settings."]
    for sec in SECTIONS:
        lines += ["", f"[{sec}]"]
        for o in (o for o in OPTIONS.values() if o.section == sec):
            value = _get(cfg, o)
            if value is not None:
                lines.append(f"{o.name} = {_toml_value(value)}")
        for key in (k for k in TABLES if k.startswith(sec + ".")):  # after the section's own keys, as TOML needs
            for item in _get_table(cfg, key):
                lines += ["", f"[[{key}]]"]
                lines += [f"{o.name} = {_toml_value(getattr(item, o.name))}" for o in TABLES[key][1].values()]
    return "\n".join(lines) + "\n"


def help_text() -> str:
    """Every option, grouped by section, with its type, default, choices or rule, and doc."""
    lines = [
        "usage: train.py [--check] [--job.config_file FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "Precedence: command line > TOML file > defaults. Booleans: --section.key, --no-section.key,",
        "or --section.key true|false. Optional numbers accept 'none'.",
        "--check (anywhere; ./run_train.sh takes it too): check the config for WORLD_SIZE processes (environment",
        "variable, default 1; run_train.sh: NGPU) and print the run's plan, without training: exit 0, or one",
        "error line and exit 2.",
    ]
    for sec, cls in SECTIONS.items():
        lines += ["", f"[{sec}]  {cls.__doc__}"]
        for o in (o for o in OPTIONS.values() if o.section == sec):
            lines += [f"  --{o.key} {_kind(o)} = {_default(o)}{_choices(o)}{_rule(o)}", f"      {o.help}"]
        for key, (cls, options) in ((k, t) for k, t in TABLES.items() if k.startswith(sec + ".")):
            lines.append(f"  [[{key}]]  (TOML only) {cls.__doc__}")
            for o in options.values():
                lines += [f"    {o.name} {_kind(o)} = {_default(o)}{_choices(o)}{_rule(o)}", f"        {o.help}"]
    return "\n".join(lines)


def _kind(o: _Opt) -> str:
    return o.type.__name__ + ("|none" if o.optional else "")


def _default(o: _Opt) -> str:
    return "none" if o.default is None else _toml_value(o.default)


def _choices(o: _Opt) -> str:
    return f"  {{{', '.join(o.choices)}}}" if o.choices else ""


def _rule(o: _Opt) -> str:
    return f"  must be {_allowed(o)}" if o.rule else ""
