"""`bench gpu parts=stage`: LLM layers and the vision tower as the runtime's stage programs, at MFU.

Each stage program is timed on one device by the profiler's `measure_program` as training runs it,
per attention implementation, residual policy and LLM remat policy (`_stage_variants`: most telling
rows first); MFU counts model FLOPs, HFU what the backward re-runs too (`hardware_factor`).
"""

from __future__ import annotations

from dflop_jax.bench.gpu.attention_kernels import attention_impls
from dflop_jax.bench.gpu.sizes import STAGE_MODULES, Size


def _stage_cases(arch, size: Size):
    """(name, StageShape, bucket, model FLOPs of fwd + bwd) of the stage part."""
    from dflop_jax.costs.flops import causal_pairs, llm_layer_flops, vision_flops_per_tile
    from dflop_jax.profiling.programs import StageShape

    n, tiles = size.llm_tokens, size.encoder_tiles
    llm = 3 * size.llm_layers * llm_layer_flops(arch.llm, n, causal_pairs([n]))
    vit = 3 * tiles * vision_flops_per_tile(arch.vision)
    return (
        (f"llm {size.llm_layers} layers", StageShape("llm", size.llm_layers), n, llm),
        (f"vision tower {arch.vision.num_layers} layers + patch embedding",
         StageShape("encoder", arch.vision.num_layers, has_embedding=True), tiles, vit),
    )  # fmt: skip


def _stage_variants(impls, remats, policies) -> list[tuple[str, str, str, str]]:
    """(module, attention implementation, LLM remat, residual policy) per stage program timed, most
    telling first (a deadline keeps the first rows): the LLM stage per implementation under the first
    residual policy (no remat), then under each other policy with the first implementation after
    XLA (the fused kernel where one runs), the vision tower per implementation, then the LLM stage
    under each other remat policy (first policy, that implementation)."""
    best = impls[1] if len(impls) > 1 else impls[0]
    first = policies[0]
    return ([("llm", i, "none", first) for i in impls]
            + [("llm", best, "none", p) for p in policies[1:]]
            + [("encoder", i, "none", first) for i in impls]
            + [("llm", best, r, first) for r in remats if r != "none"])  # fmt: skip


def hardware_factor(residuals: str, remat: str) -> float:
    """Executed over model FLOPs of a stage step (matmuls): the backward's own 2x, plus the forward
    again where the backward re-runs it ("recompute": the stage's; "layers": each layer's; full
    layer remat under "recompute": a third time). "dots" remat keeps the matmuls' outputs."""
    again = (residuals != "all") + (residuals == "recompute" and remat == "full")
    return (3 + again) / 3


def stage_part(size: Size, info: dict, warmup: int, runs: int, remats=("none",),
               policies=("all",), impls=(), progress=lambda rows: None,
               modules=STAGE_MODULES) -> dict:  # fmt: skip
    """Each stage program timed on one device by the profiler's `measure_program`, as the runtime
    trains it under each residual policy; MFU and HFU, per attention implementation (`impls`, () =
    every one that runs here) and LLM remat policy, of the stages of `modules` ("llm", "encoder").
    `progress(rows)` after each row (partial saves). The report's `auto` names the kernels
    `model.attention_impl: auto` picks here (its rows are theirs)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dflop_jax.contracts.profile_settings import ProfileSettings
    from dflop_jax.costs import get_arch
    from dflop_jax.costs.flops import mfu
    from dflop_jax.profiling.model_profiler import measure_program
    from dflop_jax.profiling.programs import build_program
    from dflop_jax.programs.devices import local_attention_kernels
    from dflop_jax.programs.model_section import model_config_for_arch
    from models.stage_modules import with_remat

    arch = get_arch(size.arch)
    base = model_config_for_arch(arch, "bfloat16")
    settings = ProfileSettings(tps=(1,), warmup=warmup, runs=runs, memory_limit_bytes=2.0**60)
    cases = {shape.module: c for c in _stage_cases(arch, size) for shape in [c[1]]}
    impls, _ = attention_impls(info, impls)
    rows = []
    for module, impl, remat, residuals in _stage_variants(impls, remats, policies):
        if module not in modules:
            continue
        name, shape, bucket, flops = cases[module]
        model_cfg = with_remat(base, {"vision": "none", "llm": remat})
        model_cfg = dataclasses.replace(model_cfg,
                                        vision=model_cfg.vision.replace(attention_impl=impl),
                                        text=model_cfg.text.replace(attention_impl=impl))  # fmt: skip
        key = {
            "stage": name,
            "module": shape.module,
            "bucket": bucket,
            "attention": impl,
            "remat": remat,
            "residuals": residuals,
        }
        try:
            prog = build_program(model_cfg, shape, 1, bucket, jax.devices()[:1], jnp.bfloat16,
                                 residuals=residuals)  # fmt: skip
            m = measure_program(prog, settings)
        except (
            Exception
        ) as e:  # one variant failing (out of memory, a kernel's limits) keeps the rest
            rows.append({**key, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"})
            progress(rows)
            continue
        step = m["fwd_s"] + m["bwd_s"]
        rows.append({**key, "fwd_s": m["fwd_s"], "bwd_s": m["bwd_s"], "step_s": step,
                     "model_flops": flops,
                     # XLA's count: a loop body once, whatever its trips (not the tiled attention's)
                     "xla_flops": m["flops_fwd"] + m["flops_bwd"],
                     "xla_bytes": m["bytes_fwd"] + m["bytes_bwd"],
                     "memory_peak_bytes": max(m["memory_fwd"]["peak"],
                                              m["memory_bwd"].get("peak", 0.0)),
                     "mfu": mfu(flops, step, 1, info["peak_flops"]),
                     "hfu": hardware_factor(residuals, remat) * flops / (step * info["peak_flops"])})  # fmt: skip
        progress(rows)
    auto = local_attention_kernels()
    return {"arch": size.arch, "peak_flops": info["peak_flops"], "stages": rows,
            "auto": {"llm": auto.llm, "vision": auto.vision}}  # fmt: skip
