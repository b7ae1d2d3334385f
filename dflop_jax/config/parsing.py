"""Typed config loading: YAML data + `key.sub=value` overrides (+ gin-style binding files) -> frozen dataclasses.

The schema is the dataclasses (one per component, defaults only there); YAML is data. Every error is a
one-line `ConfigError` naming the dotted key, the bad value and what is allowed. Loading also checks
the files the config reads (`config/inputs.py`) and warns, in one line, about keys the config's mode
ignores (a root config's `ignored_keys()`), so a run fails or says so before any JAX work.

    cfg = load_config(TrainConfig, "configs/demo.yaml", ["scheduler.time_limit_s=2", "steps=10"])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from dflop_jax.config.config_error import ConfigError

T = TypeVar("T")
log = logging.getLogger(__name__)


# Where a section's shorthand value (`device: h100`) waits for the schema to name its key
# (the section's `SHORTHAND`, e.g. `preset`) once an override has opened the section.
SHORTHAND_KEY = "<shorthand>"


@typing.runtime_checkable
class ModalConfig(typing.Protocol):
    """A root config some of whose sections only apply in some modes (e.g. `layout` with an explicit plan)."""

    def ignored_keys(self) -> dict[str, str]:
        """Dotted key prefixes this config ignores as set -> why (e.g. {"layout": "plan is auto"})."""


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    gin_files: typing.Sequence[str | Path] = (),
) -> T:
    """Builds `cls` from an optional YAML file, then gin binding files, then `key=value` overrides.

    Then checks the files the config reads (`check_inputs`) and logs one warning naming the given keys
    the config's mode ignores. Raises `ConfigError` (one line) on any problem.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
    for gin_file in gin_files:
        data = apply_overrides(data, read_gin_bindings(gin_file))
    data = apply_overrides(data, overrides)
    cfg = from_dict(cls, data)
    from dflop_jax.config.inputs import check_inputs  # inputs imports this module

    check_inputs(cfg)
    _warn_ignored(cfg, data)
    return cfg


def _warn_ignored(cfg: Any, data: dict[str, Any]) -> None:
    """One warning line naming the given keys that `cfg`'s mode ignores (never silently dropped)."""
    if not isinstance(cfg, ModalConfig):
        return
    ignored = cfg.ignored_keys()
    hits = [k for k in _given_keys(data) if any(_under(k, p) for p in ignored)]
    if hits:
        why = "; ".join(f"{p}: {r}" for p, r in ignored.items() if any(_under(h, p) for h in hits))
        log.warning("ignored config keys %s (%s)", ", ".join(hits), why)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _given_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted leaf keys set in raw config data (YAML + overrides), in order."""
    out = []
    for k, v in data.items():
        key = _join(prefix, str(k))
        out.extend(_given_keys(v, key) if isinstance(v, dict) and v else [key])
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


_GIN_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*=\s*(.+?)\s*$")


def read_gin_bindings(path: str | Path) -> list[str]:
    """Reads gin-style bindings (`scheduler.time_limit_s = 2.0`, one per line, `#` comments).

    The syntax is the project's own (a subset of gin's binding lines); the `gin-config` package is not
    needed for it.

    Bindings set config fields only (never functions deep in the code); they become overrides.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"gin file not found: {path}")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0]
        if not line.strip():
            continue
        m = _GIN_LINE.match(line)
        if not m:
            raise ConfigError(f"{path}:{lineno}: expected `key.sub = value`, got {line.strip()!r}")
        out.append(f"{m.group(1)}={m.group(2)}")
    return out


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Returns a copy of `data` with each `a.b.c=value` set; values are parsed as YAML scalars/lists."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. steps=10")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str):  # `device: h100` then `device.memory_gib=80`
                child = node[part] = {SHORTHAND_KEY: child}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Builds dataclass `cls` from a mapping, checking keys and types; nested dataclasses recurse."""
    where = prefix or "<root>"
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{_join(prefix, unknown[0])}: unknown key; allowed keys of {where}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(prefix, name))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_qualify(str(e), prefix, fields)) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _qualify(message: str, prefix: str, fields: typing.Iterable[str]) -> str:
    """Gives a nested config's own key its full path (`planner.tp` under `x` -> `x.planner.tp`).

    `__post_init__` names keys as the config sits in its usual root; the same config nested one level
    deeper must still name the key a person would write.
    """
    m = re.match(r"[A-Za-z_][\w.]*", message)
    if not prefix or not m:
        return message
    parts, head = prefix.split("."), m.group(0).split(".")[0]
    if head in fields:
        return f"{prefix}.{message}"
    if head == parts[-1] and len(parts) > 1:
        return ".".join(parts[:-1]) + "." + message
    return message


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, _expand_shorthand(tp, value, key), key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}"
        )
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if value not in args:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, args))}"
            )
        return value
    if origin in (tuple, list):
        if isinstance(value, str):
            # `a.b=4,8,16` on a command line: each item is a YAML scalar.
            value = [_list_item(v, key) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        elem = args[0] if args else Any
        return [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_convert(kt, k, key): _convert(vt, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{key}: expected a path, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")


def _expand_shorthand(cls: type, value: Any, key: str) -> Any:
    """A section's shorthand (`device: h100` = `device: {preset: h100}`) as its mapping."""
    shorthand = getattr(cls, "SHORTHAND", None)
    if isinstance(value, dict) and SHORTHAND_KEY in value:
        if not shorthand:
            raise ConfigError(f"{key}: expected a mapping, got {value[SHORTHAND_KEY]!r}")
        value = {
            shorthand: value[SHORTHAND_KEY],
            **{k: v for k, v in value.items() if k != SHORTHAND_KEY},
        }
    elif shorthand and isinstance(value, str):
        value = {shorthand: value}
    return value


def _list_item(raw: str, key: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(
            f"{key}: cannot read {raw.strip()!r} as a list item; give e.g. [1, 2]"
        ) from None


def to_dict(cfg: Any) -> Any:
    """Plain YAML-able data of a config (tuples become lists, paths strings)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """Writes the resolved config (what a run actually used) as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def require(condition: bool, key: str, value: Any, fix: str) -> None:
    """Validation helper for `__post_init__`: raises a one-line ConfigError naming key, value and fix."""
    if not condition:
        raise ConfigError(f"{key}={value!r}: {fix}")


def require_seed(value: int, key: str) -> None:
    """Seeds feed numpy and JAX PRNGs, which take 0 .. 2**32-1."""
    require(0 <= value < 2**32, key, value, "use a seed in 0 .. 2**32-1")
