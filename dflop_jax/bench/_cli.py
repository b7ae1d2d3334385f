"""The one command-line form of a benchmark: `python -m dflop_jax.bench NAME [--config FILE] [key=value ...]`.

Each benchmark module holds its `COMMAND` (a `dflop_jax.config.cli.Command`) and a frozen config
dataclass; `load` parses the line and builds the config once, so a bad value is one `config error:`
line and exit status 2 before any benchmark work starts.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

from dflop_jax.config import ConfigError
from dflop_jax.config.cli import Command, config_error, load_command_config

T = TypeVar("T")


def command(name: str, description: str, example: str, **modes: str) -> Command:
    """The `Command` of benchmark `name`; `modes` are its mode flags and their help text."""
    return Command(
        prog=f"python -m dflop_jax.bench {name}",
        description=description,
        example=example,
        modes=modes,
    )


def load(cmd: Command, cls: type[T], argv: list[str] | None) -> tuple[T, argparse.Namespace]:
    """The benchmark's config and the parsed line (its modes); a bad config exits 2 in one line."""
    args = cmd.parse(argv)
    try:
        return load_command_config(cls, args), args
    except ConfigError as e:
        raise SystemExit(config_error(e)) from None
