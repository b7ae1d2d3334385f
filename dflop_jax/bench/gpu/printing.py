"""The console report of `bench gpu`: each part's Markdown table or lines, labelled with the device."""

from __future__ import annotations

from dflop_jax.bench.gpu.op_profile import print_ops
from dflop_jax.bench.gpu.real_model import print_model
from dflop_jax.bench.gpu.sizes import CPU_BANNER, GOAL_LLM_MFU
from dflop_jax.bench.gpu.training_parts import print_host, print_profiler


def device_label(info: dict) -> str:
    return f"  [{CPU_BANNER}]" if not info["gpu"] else f"  [{info['gpu_name']}]"


def _print_attention(rep: dict, info: dict) -> None:
    print(f"\n## attention (H, K, Dh) = {tuple(rep['heads'])}, causal, tolerance {rep['tolerance']}"
          + device_label(info))  # fmt: skip
    if rep["note"]:
        print(rep["note"])
    print("| tokens | samples | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
          "fwd+bwd temp MiB | err vs fp32 out / grad |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for c in rep["cases"]:
        for impl, r in c["impls"].items():
            p, temp = r["vs_fp32"], r["fwd_bwd_temp_bytes"]
            print(f"| {c['length']} | {c['samples']} | {impl} | {r['fwd_s'] * 1e3:.2f} | "
                  f"{r['fwd_tflops']:.3g} | {r['fwd_bwd_s'] * 1e3:.2f} | {r['fwd_bwd_tflops']:.3g} | "
                  f"{'-' if temp is None else f'{temp / 2**20:.1f}'} | "
                  f"{p['out']:.2e} / {p['grad']:.2e}{'' if p['ok'] else ' OVER TOLERANCE'} |")  # fmt: skip
        for impl in c["impls"]:
            if f"{impl}_vs_xla" in c:
                p = c[f"{impl}_vs_xla"]
                print(f"{impl} vs xla at {c['length']}x{c['samples']}: out {p['out']:.2e}, grad "
                      f"{p['grad']:.2e} ({'within' if p['ok'] else 'OVER'} tolerance)")  # fmt: skip
    for impl, why in rep.get("not_measured", {}).items():
        print(f"{impl}: not measured: {why}")


def _print_stage(rep: dict, info: dict) -> None:
    print(f"\n## stage programs ({rep['arch']}), peak {rep['peak_flops'] / 1e12:.3g} TFLOP/s "
          f"({info['peak_source']})" + device_label(info))  # fmt: skip
    print("| stage | bucket | attention | LLM remat | residuals | fwd ms | bwd ms | step ms | "
          "peak GiB | MFU | HFU (with what the backward re-runs) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rep["stages"]:
        head = (f"| {r['stage']} | {r['bucket']} | {r['attention']} | {r['remat']} | "
                f"{r['residuals']} |")  # fmt: skip
        if "error" in r:
            print(f"{head} failed: {r['error'][:200]} |||||")
            continue
        print(f"{head} {r['fwd_s'] * 1e3:.1f} | {r['bwd_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
              f"{r['memory_peak_bytes'] / 2**30:.2f} | {r['mfu']:.1%} | {r['hfu']:.1%} |")  # fmt: skip
    if "auto" in rep:
        print(f"model.attention_impl=auto runs {rep['auto']['llm']} in the LLM stage and "
              f"{rep['auto']['vision']} in the tower here: its rows are those")  # fmt: skip
    llms = [r for r in rep["stages"] if r["module"] == "llm" and "error" not in r]
    llm = max(llms, key=lambda r: r["mfu"], default=None)
    if llm is not None and llm["mfu"] < GOAL_LLM_MFU:
        print(f"misses goal: LLM stage MFU {llm['mfu']:.1%} < {GOAL_LLM_MFU:.0%} at best "
              f"({llm['attention']}, remat {llm['remat']}, residuals {llm['residuals']}; "
              f"HFU {llm['hfu']:.1%})" + device_label(info))  # fmt: skip


def part_printers():
    """{part: printer(report part, device info)}."""
    own = {"attention": _print_attention, "stage": _print_stage}
    labelled = {"profiler": print_profiler, "host": print_host, "ops": print_ops,
                "model": print_model, "model_blind": print_model}  # fmt: skip
    return own | {
        k: (lambda rep, info, f=f: f(rep, info, device_label(info))) for k, f in labelled.items()
    }
