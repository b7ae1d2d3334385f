"""The files a config reads, checked once at load: a missing input is a one-line `ConfigError`.

A config dataclass names its inputs with `inputs()` (see `InputPath`); `check_inputs` walks the whole
config tree, so the trainer, planner and profiler fail on a missing data file, plan, tokenizer or model
directory before any JAX work instead of in a traceback minutes later.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dflop_jax.config.config_error import ConfigError


@dataclasses.dataclass(frozen=True)
class InputPath:
    """One path a config reads.

    Attributes:
      key: the field, relative to the config that names it (`check_inputs` adds the section prefix).
      path: the configured path (`~` expands).
      kind: "file" or "dir".
      fix: what to give instead, for the error message.
      contains: for a dir, a file that must be inside it (e.g. "config.json").
      parse: for a file, a reader that raises ValueError when the file exists but is unusable (a
        malformed plan.yaml), so that too is a load-time error rather than a traceback after the
        model is built.
    """

    key: str
    path: str
    kind: Literal["file", "dir"]
    fix: str
    contains: str = ""
    parse: Callable[[Path], object] | None = None


@typing.runtime_checkable
class HasInputs(typing.Protocol):
    """A config dataclass that reads files."""

    def inputs(self) -> list[InputPath]:
        """The paths this config's current values read."""


def check_inputs(cfg: Any, prefix: str = "") -> None:
    """Raises `ConfigError` for the first input of `cfg` (or of a nested config) missing on disk."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return
    if isinstance(cfg, HasInputs):
        for item in cfg.inputs():
            _check(item, f"{prefix}.{item.key}" if prefix else item.key)
    for field in dataclasses.fields(cfg):
        check_inputs(getattr(cfg, field.name), f"{prefix}.{field.name}" if prefix else field.name)


def _check(item: InputPath, key: str) -> None:
    path = Path(item.path).expanduser()
    if item.kind == "file" and not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "file not found"
        raise ConfigError(f"{key}={item.path!r}: {what}; {item.fix}")
    if item.kind == "dir" and not path.is_dir():
        raise ConfigError(f"{key}={item.path!r}: directory not found; {item.fix}")
    if item.contains and not (path / item.contains).is_file():
        raise ConfigError(f"{key}={item.path!r}: no {item.contains} in it; {item.fix}")
    if item.parse is not None:
        try:
            item.parse(path)
        except ValueError as e:
            raise ConfigError(f"{key}={item.path!r}: {e}; {item.fix}") from None
