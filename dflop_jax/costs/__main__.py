"""Print an architecture's sizes and its analytic stage costs per tp and bucket.

python -m dflop_jax.costs arch=siglip-so400m+qwen2.5-7b device=h100 "tp=[1,2,4,8]"
python -m dflop_jax.costs --list
"""

from __future__ import annotations

import dataclasses
import json
import sys

from dflop_jax.config import ConfigError, require
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.contracts.layout import StageSpec
from dflop_jax.costs.architectures import DEFAULT_ARCH, get_arch, list_archs
from dflop_jax.costs.device_specs import get_device, list_devices
from dflop_jax.costs.flops import (
    llm_flops,
    param_count,
    projector_flops_per_tile,
    vision_flops_per_tile,
)
from dflop_jax.costs.provider import AnalyticCostProvider

COMMAND = Command(
    prog="python -m dflop_jax.costs",
    description=__doc__.split("\n")[0],
    example='python -m dflop_jax.costs arch=siglip-so400m+qwen2.5-7b device=h100 "tp=[1,4]"',
    modes={"json": "print JSON instead of text", "list": "list the architecture names and exit"},
)


@dataclasses.dataclass(frozen=True)
class CostsConfig:
    """Which architecture, device and buckets to cost.

    Attributes:
      arch: architecture name (`--list` prints them).
      device: device preset.
      tp: tensor-parallel degrees.
      tiles: tile buckets (whole encoder).
      lengths: length buckets (whole LLM).
      remat: full activation recomputation in the backward.
    """

    arch: str = DEFAULT_ARCH
    device: str = "h100"
    tp: tuple[int, ...] = (1, 2, 4, 8)
    tiles: tuple[int, ...] = (1, 8, 32)
    lengths: tuple[int, ...] = (2048, 8192, 32768)
    remat: bool = False

    def __post_init__(self):
        require(
            self.device in list_devices(), "device", self.device, f"use one of {list_devices()}"
        )
        for name in ("tp", "tiles", "lengths"):
            value = getattr(self, name)
            require(bool(value) and min(value) >= 1, name, list(value), "give a list of ints >= 1")


def report(cfg: CostsConfig) -> dict:
    """Sizes, FLOPs and whole-module (fwd, bwd) seconds per tp and bucket (one stage, dp shard)."""
    arch, device = get_arch(cfg.arch), get_device(cfg.device)
    prov = AnalyticCostProvider(arch, device, remat=cfg.remat)
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
            **{f"llm_{s}_tokens": llm_flops(arch.llm, [s]) for s in cfg.lengths},
        },
        "encoder_s": {tp: {t: prov.stage_time(enc(tp), t) for t in cfg.tiles} for tp in cfg.tp},
        "llm_s": {tp: {s: prov.stage_time(llm(tp), s) for s in cfg.lengths} for tp in cfg.tp},
        "llm_memory_gib": {
            tp: {s: prov.stage_memory(llm(tp), s).total() / 2**30 for s in cfg.lengths}
            for tp in cfg.tp
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
    args = COMMAND.parse(argv)
    if args.list:
        print("\n".join(list_archs()))
        return 0
    try:
        r = report(load_command_config(CostsConfig, args))
    except ConfigError as e:
        return config_error(e)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1)) if args.json else _print_text(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
