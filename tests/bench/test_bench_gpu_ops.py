"""`bench gpu parts=ops` (the vision tower op by op) and the real-model parts' step figures.

The trace parser is checked on a hand-written GPU trace (stream kernels carrying their HLO op and
module, a derived "XLA Ops" line that must not count twice, host events) and on this CPU's own
trace of a small program; the HLO reader on real compiled text; the part end to end at the smoke size.
"""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from dflop_jax.bench.gpu import op_profile as ops
from dflop_jax.bench.gpu.real_model import arm_figures


def _gpu_trace() -> list[dict]:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 101, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "process_name", "pid": 701, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 701, "tid": 3, "args": {"name": "python"}},
    ]  # fmt: skip

    def kernel(name, dur, op, module="jit_fwd"):
        return {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": dur, "name": name,
                "args": {"hlo_op": op, "hlo_module": module}}  # fmt: skip

    return [
        *meta,
        kernel("nvjet_gemm_a", 300.0, "dot.1"),  # one op, two kernels: summed, the longer named
        kernel("nvjet_gemm_b", 100.0, "dot.1"),
        kernel("loop_fusion_kernel", 50.0, "fusion.3"),
        kernel(
            "loop_fusion_kernel", 50.0, "fusion.3", module="jit_bwd"
        ),  # same name, other program
        kernel("cudnn_fmha", 500.0, "custom-call.2", module="jit_bwd"),
        # the derived per-op line repeats the stream's time: not counted again
        {"ph": "X", "pid": 1, "tid": 101, "ts": 0, "dur": 400.0, "name": "dot.1"},
        {"ph": "X", "pid": 701, "tid": 3, "ts": 0, "dur": 9000.0, "name": "PjitFunction(f)"},
    ]


def test_gpu_trace_op_times_come_from_the_stream_kernels():
    source, rows = ops.op_times(_gpu_trace())
    assert source == "gpu streams"
    assert rows[("jit_fwd", "dot.1")] == {"us": 400.0, "calls": 2, "kernel": "nvjet_gemm_a"}
    assert rows[("jit_bwd", "custom-call.2")]["us"] == 500.0
    assert rows[("jit_fwd", "fusion.3")]["us"] == rows[("jit_bwd", "fusion.3")]["us"] == 50.0
    assert sum(r["us"] for r in rows.values()) == 1000.0  # neither the XLA Ops line nor the host
    programs = {
        "fwd": ("jit_fwd", {"dot.1": "dot", "fusion.3": "fusion kLoop"}),
        "bwd": (
            "jit_bwd",
            {"fusion.3": "fusion kInput", "custom-call.2": "custom-call __cudnn$fmha"},
        ),
    }
    top, per_step = ops.top_ops(rows, programs, steps=2, top=3)
    assert per_step == pytest.approx(0.5)  # 1000 us over 2 steps
    assert [(r["op"], r["program"], r["hlo"]) for r in top] == [
        ("custom-call.2", "bwd", "custom-call __cudnn$fmha"),
        ("dot.1", "fwd", "dot"),
        ("fusion.3", "fwd", "fusion kLoop"),  # the module tells the two fusion.3 apart
    ]
    assert [r["share"] for r in top] == pytest.approx([0.5, 0.4, 0.05])
    assert top[1]["calls_per_step"] == 1 and top[1]["ms_per_step"] == pytest.approx(0.2)


def test_a_trace_without_op_events_says_none():
    host_only = [e for e in _gpu_trace() if e.get("pid") != 1]
    assert ops.op_times(host_only) == ("none", {})


def test_hlo_ops_names_each_instruction_of_compiled_text():
    text = "\n".join([
        "HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}",
        "%fused_computation (p: f32[8]) -> f32[8] {",
        "  %p = f32[8]{0} parameter(0)",
        "  ROOT %exp.1 = f32[8]{0} exponential(f32[8]{0} %p)",
        "}",
        "ENTRY %main (a: f32[8]) -> (f32[8], f32[2]) {",
        "  %a = f32[8]{0} parameter(0)",
        "  %fusion.7 = f32[8]{0} fusion(f32[8]{0} %a), kind=kLoop, calls=%fused_computation",
        '  %custom-call.3 = (bf16[4,2]{1,0}, u8[0]{0}) custom-call(f32[8]{0} %a), '
        'custom_call_target="__cudnn$fmhaSoftmax"',
        "  ROOT %tuple.2 = (f32[8]{0}, f32[2]{0}) tuple(f32[8]{0} %fusion.7, f32[2]{0} %a)",
        "}",
    ])  # fmt: skip
    module, found = ops.hlo_ops(text)
    assert module == "jit_step"
    assert found["fusion.7"] == "fusion kLoop" and found["exp.1"] == "exponential"
    assert found["custom-call.3"] == "custom-call __cudnn$fmhaSoftmax"
    assert found["tuple.2"] == "tuple" and found["a"] == "parameter"
    # the real thing: every fusion of a compiled program is named
    compiled = jax.jit(lambda x: jnp.tanh(x @ x).sum(0)).lower(jnp.ones((16, 16))).compile()
    module, found = ops.hlo_ops(compiled.as_text())
    assert module.startswith("jit_") and found and all(found.values())


def test_this_cpus_trace_gives_the_table(tmp_path):
    """The CPU path the dry mode runs: XLA:CPU's op events, named after the compiled program's ops."""
    f = jax.jit(lambda a, b: jax.nn.gelu(a @ b).sum(0) + jnp.tanh(a).mean())
    a = jnp.ones((128, 128))
    compiled = f.lower(a, a).compile()
    jax.block_until_ready(compiled(a, a))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(2):
            jax.block_until_ready(compiled(a, a))
    source, rows = ops.op_times(ops.trace_events(tmp_path))
    assert source == "cpu threads" and rows
    programs = {"fwd": ops.hlo_ops(compiled.as_text())}
    top, per_step = ops.top_ops(rows, programs, steps=2)
    assert per_step > 0 and sum(r["share"] for r in top) <= 1 + 1e-9
    assert any(r["program"] == "fwd" for r in top)  # the trace's op names are the HLO's


def test_ops_part_at_the_smoke_size(tmp_path, capsys):
    from dflop_jax.bench import gpu

    path = tmp_path / "ops.json"
    argv = ["parts=ops", "size=smoke", f"out={tmp_path}", f"json_out={path}", "warmup=0", "runs=2"]
    assert gpu.main(argv) == 0
    rep = json.loads(path.read_text())["ops"]
    assert (rep["tiles"], rep["tokens_per_tile"], rep["attention"]) == (2, 16, "xla")
    assert rep["source"] == "cpu threads" and rep["traced_steps"] == 2
    assert 0 < len(rep["top"]) <= ops.TOP and rep["ops"] >= len(rep["top"])
    shares = [r["share"] for r in rep["top"]]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 1 + 1e-9
    assert all(r["program"] for r in rep["top"][:5])  # named from the compiled programs
    table = rep["table_md"]
    assert table.count("\n| ") == len(rep["top"]) + 1 and gpu.CPU_BANNER in table  # + header
    assert "## per-op profile" in capsys.readouterr().out
    assert list((tmp_path / "ops_trace").rglob("*.trace.json.gz"))
    with gzip.open(next((tmp_path / "ops_trace").rglob("*.trace.json.gz")), "rt") as f:
        assert json.load(f)["traceEvents"]


def _row(step, time_s, tokens_s, *, recompiles=0, measured=False, dispatch=0.1, mfu=0.5):
    return {"step": step, "step_time_s": time_s, "tokens_per_s": tokens_s, "mfu": mfu,
            "recompiles": recompiles, "stage_times_measured": measured, "dispatch_s": dispatch,
            "data_wait_s": 0.01 * step, "predicted_step_time_s": 1.0, "llm_padding_ratio": 0.1,
            "loss": 10.0 - step}  # fmt: skip


def test_arm_figures_count_only_steady_steps():
    """Steady: after step 1, compiling nothing, not timing stages; tokens/s and MFU time-weighted."""
    rows = [_row(1, 60.0, 10.0, recompiles=9), _row(2, 1.0, 1000.0), _row(3, 3.0, 2000.0, measured=True),
            _row(4, 2.0, 4000.0, mfu=0.2), _row(5, 5.0, 100.0, recompiles=1)]  # fmt: skip
    f = arm_figures(rows)
    assert (f["steps"], f["steady_steps"], f["compiles_after_step_1"]) == (5, 2, 1)
    assert f["tokens_per_s"] == pytest.approx((1000.0 + 8000.0) / 3.0)
    assert f["mfu"] == pytest.approx((0.5 + 0.4) / 3.0)
    assert f["step_time_s"] == 1.5 and f["first_step_s"] == 60.0
    assert f["host_share"] == pytest.approx((0.1 + 0.05) / 2) and f["data_wait_s"] == 0.03
    assert (f["first_loss"], f["final_loss"]) == (9.0, 5.0)
    # no steady step at all: every step after the first
    only = arm_figures([_row(1, 9.0, 1.0), _row(2, 2.0, 10.0, measured=True)])
    assert only["steady_steps"] == 1 and only["tokens_per_s"] == 10.0
