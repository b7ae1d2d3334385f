"""Benchmark dispatcher: every benchmark takes the one command-line form.

python -m dflop_jax.bench NAME [--config FILE] [key=value ...] [--mode ...]
python -m dflop_jax.bench --help           # lists the benchmarks
python -m dflop_jax.bench NAME --help      # its keys, modes and an example that works
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import dflop_jax.bench as bench_pkg

EXAMPLE = "python -m dflop_jax.bench loss seq=256 hidden=64 vocab=1024 chunks=128"


def available() -> list[str]:
    """Benchmark module names in this package."""
    return sorted(
        m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_")
    )


def usage(names: list[str]) -> str:
    return (
        "usage: python -m dflop_jax.bench NAME [--config FILE] [key=value ...] [--mode ...]\n\n"
        "Runs one benchmark; NAME --help lists its keys and modes.\n\n"
        f"benchmarks: {', '.join(names) if names else '(none)'}\n\nexample:\n  {EXAMPLE}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(names), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(f"error: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"dflop_jax.bench.{name}").main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
