"""Benchmarks: `python -m dflop_jax.bench NAME [--config FILE] [key=value ...]` runs `dflop_jax.bench.NAME.main`.

Each module holds its config dataclass (the keys, checked once at load) and its `COMMAND` (modes such as
`--json`, and a `--help` example that works); `python -m dflop_jax.bench --help` lists them.
"""
