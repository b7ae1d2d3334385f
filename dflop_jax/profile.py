"""Profiling entry point.

    python -m dflop_jax.profile data --config configs/data_internvl_stats.yaml [key=value ...]
    python -m dflop_jax.profile model --config configs/profile_tiny_cpu.yaml [key=value ...]

`data`: the shape distribution of a dataset sample (see `dflop_jax.data.profile`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from dflop_jax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflop_jax.profile")
    sub = parser.add_subparsers(dest="what", required=True)
    data = sub.add_parser("data", help="shape distribution of a dataset (tiles, tokens, modality)")
    data.add_argument("--config", default=None, help="YAML with `data:` and `profile:` sections")
    data.add_argument("overrides", nargs="*", help="key=value, e.g. profile.num_samples=2000")
    from dflop_jax.profiling.cli import add_model_args, run_model

    add_model_args(sub.add_parser("model", help="per-stage cost tables (dflop_jax.profiling)"))
    args = parser.parse_args(argv)
    if args.what == "model":
        return run_model(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from dflop_jax.data.profile import DataProfileConfig, profile_data

    try:
        cfg = load_config(DataProfileConfig, args.config, args.overrides)
        path = profile_data(cfg.data, cfg.profile.num_samples, cfg.profile.seed, cfg.profile.out)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {path.with_name('shape_histogram.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
