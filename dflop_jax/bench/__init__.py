"""Benchmarks: `python -m dflop_jax.bench NAME [args]` runs `dflop_jax.bench.NAME.main(args)`.

Each module prints its tables (and JSON with `--json`); `python -m dflop_jax.bench --help` lists them.
"""
