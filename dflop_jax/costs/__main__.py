"""Print an architecture's sizes and its analytic stage costs per tp and bucket.

python -m dflop_jax.costs --model siglip-so400m+qwen2.5-7b --device h100 --tp 1,2,4,8
python -m dflop_jax.costs --list
"""

from __future__ import annotations

import argparse
import json
import sys

from dflop_jax.costs.architectures import DEFAULT_ARCH, get_arch, list_archs
from dflop_jax.costs.devices import get_device, list_devices
from dflop_jax.costs.flops import (
    llm_flops,
    param_count,
    projector_flops_per_tile,
    vision_flops_per_tile,
)
from dflop_jax.costs.layout import StageSpec
from dflop_jax.costs.provider import AnalyticCostProvider


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflop_jax.costs", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", default=DEFAULT_ARCH, help=f"architecture (default {DEFAULT_ARCH}; --list)"
    )
    p.add_argument("--device", default="h100", help=f"device preset: {', '.join(list_devices())}")
    p.add_argument(
        "--tp", type=_ints, default=[1, 2, 4, 8], help="tensor-parallel degrees, e.g. 1,2,4"
    )
    p.add_argument("--tiles", type=_ints, default=[1, 8, 32], help="tile buckets (whole encoder)")
    p.add_argument(
        "--lengths", type=_ints, default=[2048, 8192, 32768], help="length buckets (whole LLM)"
    )
    p.add_argument("--remat", action="store_true", help="full recompute in backward")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--list", action="store_true", help="list the architecture names and exit")
    return p


def report(args: argparse.Namespace) -> dict:
    """Sizes, FLOPs and whole-module (fwd, bwd) seconds per tp and bucket (one stage, dp shard)."""
    arch, device = get_arch(args.model), get_device(args.device)
    prov = AnalyticCostProvider(arch, device, remat=args.remat)
    enc = lambda tp: StageSpec(
        "encoder", 0, arch.vision.num_layers, tp=tp, has_embedding=True, has_head=True
    )
    llm = lambda tp: StageSpec(
        "llm", 0, arch.llm.num_layers, tp=tp, has_embedding=True, has_head=True
    )
    return {
        "model": arch.name,
        "device": device.name,
        "params": {
            "vision": param_count(arch.vision),
            "projector": param_count(arch.projector),
            "llm": param_count(arch.llm),
        },
        "fwd_flops": {
            "vision_per_tile": vision_flops_per_tile(arch.vision),
            "projector_per_tile": projector_flops_per_tile(arch),
            **{f"llm_{s}_tokens": llm_flops(arch.llm, [s]) for s in args.lengths},
        },
        "encoder_s": {tp: {t: prov.stage_time(enc(tp), t) for t in args.tiles} for tp in args.tp},
        "llm_s": {tp: {s: prov.stage_time(llm(tp), s) for s in args.lengths} for tp in args.tp},
        "llm_memory_gib": {
            tp: {s: prov.stage_memory(llm(tp), s).total() / 2**30 for s in args.lengths}
            for tp in args.tp
        },
    }


def _print_text(r: dict) -> None:
    print(f"{r['model']} on {r['device']}")
    for k, v in r["params"].items():
        print(f"  params {k:<10} {v / 1e9:8.3f} B")
    for k, v in r["fwd_flops"].items():
        print(f"  fwd FLOPs {k:<20} {v / 1e12:10.3f} T")
    for title, key, unit in (("encoder", "encoder_s", "tiles"), ("llm", "llm_s", "tokens")):
        print(f"  {title} (whole module, one stage): fwd/bwd ms")
        for tp, row in r[key].items():
            cells = "  ".join(
                f"{b} {unit}: {f * 1e3:8.2f}/{bw * 1e3:8.2f}" for b, (f, bw) in row.items()
            )
            print(f"    tp={tp}: {cells}")
    print("  llm (whole module) peak memory GiB at 1 in-flight microbatch")
    for tp, row in r["llm_memory_gib"].items():
        print(f"    tp={tp}: " + "  ".join(f"{s}: {g:7.1f}" for s, g in row.items()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print("\n".join(list_archs()))
        return 0
    try:
        r = report(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1)) if args.json else _print_text(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
