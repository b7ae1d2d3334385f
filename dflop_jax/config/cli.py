"""The one command-line form of every entry point.

    python -m dflop_jax.<command> [--config FILE] [--gin FILE] [key=value ...] [--mode ...]

Settings are config keys (`key.sub=value`, typed and checked by the command's config dataclass); flags
only pick a mode (`--check`, `--dry-run`, `--json`, `--list`, `--help`). Every `--help` ends with an
example that works (`tests/cli/test_cli_examples.py` runs each).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from dflop_jax.config.config_error import ConfigError
from dflop_jax.config.parsing import load_config

T = typing.TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Command:
    """One entry point's command line.

    Attributes:
      prog: how it is called, e.g. "python -m dflop_jax.export".
      description: one line: what it does.
      example: a full command line that works from the repository root (printed last by --help).
      modes: mode flags (without "--") -> help text.
      positional: a leading sub-command's name and choices, e.g. ("what", ("data", "model")).
    """

    prog: str
    description: str
    example: str
    modes: dict[str, str] = dataclasses.field(default_factory=dict)
    positional: tuple[str, tuple[str, ...]] | None = None

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog=self.prog,
            description=self.description,
            epilog=f"example:\n  {self.example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if self.positional:
            name, choices = self.positional
            p.add_argument(name, choices=choices)
        p.add_argument("--config", type=Path, default=None, help="YAML config file")
        p.add_argument(
            "--gin", action="append", default=[], help="file of `section.key = value` lines"
        )
        for flag, text in self.modes.items():
            p.add_argument(f"--{flag}", action="store_true", help=text)
        p.add_argument("overrides", nargs="*", help="config keys, e.g. steps=10 optimizer.lr=1e-3")
        return p

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """The parsed line; a setting given as a flag (`--out X`) gets a one-line hint and exit 2."""
        args, extra = self.parser().parse_known_intermixed_args(argv)
        if extra:
            flag = extra[0]
            key = flag.lstrip("-").replace("-", "_").split("=", 1)[0]
            print(
                f"{self.prog}: {flag}: settings are key=value (e.g. {key}=...); flags only pick a "
                f"mode ({', '.join('--' + m for m in self.modes) or 'none here'}); see --help",
                file=sys.stderr,
            )
            raise SystemExit(2)
        for item in args.overrides:
            if "=" not in item:
                print(f"{self.prog}: {item!r}: expected key=value; see --help", file=sys.stderr)
                raise SystemExit(2)
        return args


def load_command_config(cls: type[T], args: argparse.Namespace, default: Path | None = None) -> T:
    """The command's config from `--config` (or `default`), `--gin` files and key=value overrides."""
    return load_config(cls, args.config or default, args.overrides, args.gin)


def config_error(e: Exception) -> int:
    """One line on stderr, exit status 2: what every entry point does with a bad config."""
    print(f"config error: {e}", file=sys.stderr)
    return 2


__all__ = ["Command", "ConfigError", "config_error", "load_command_config"]
