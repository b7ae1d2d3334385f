"""Benchmark dispatcher.

python -m dflop_jax.bench NAME [args...]   # imports dflop_jax.bench.NAME, calls main(args) -> int
python -m dflop_jax.bench --help           # lists the benchmark modules
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import dflop_jax.bench as bench_pkg


def available() -> list[str]:
    """Benchmark module names in this package."""
    return sorted(
        m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_")
    )


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m dflop_jax.bench NAME [args...]  (NAME --help for its options)")
        print("benchmarks: " + (", ".join(names) if names else "(none)"))
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(f"error: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"dflop_jax.bench.{name}").main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
