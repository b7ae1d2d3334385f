"""`bench gpu parts=attention`: each attention implementation that runs here on packed rows.

Output and gradient parity against XLA and against a dense fp32 reference (bf16 tolerances
ATTN_TOL), time, achieved TFLOP/s (model FLOPs: causal pairs x 4 Dh H forward, 3x that forward +
backward) and XLA's temp memory; `attention_impls` probes which implementations run here.
"""

from __future__ import annotations

import time

import numpy as np

from dflop_jax.bench.gpu.sizes import Size

# bf16 parity: max |a - b| / max |reference| (8-bit mantissa: 2^-8 per rounding, sums of many terms).
ATTN_TOL = {"out": 2e-2, "grad": 5e-2}


def _attention_inputs(length: int, samples: int, heads: tuple[int, int, int], rng):
    """bf16 q, k, v of one packed row of `samples` equal segments (no padding), and an fp32 cotangent."""
    import jax.numpy as jnp

    h, kv, dh = heads
    q, k, v, dy = (rng.standard_normal((1, length, n, dh)).astype(np.float32)
                   for n in (h, kv, kv, h))  # fmt: skip
    seg = np.repeat(np.arange(1, samples + 1, dtype=np.int32), length // samples)[None]
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), jnp.asarray(seg), jnp.asarray(dy)


def _reference_attention(q, k, v, seg):
    """Dense fp32 segment-causal attention, one head at a time (independent of `models/`)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    rep, length, dh = q.shape[2] // k.shape[2], q.shape[1], q.shape[3]
    mask = (seg[0][:, None] == seg[0][None, :]) & jnp.tril(jnp.ones((length, length), bool))

    def head(h):
        s = (q[0, :, h] @ k[0, :, h // rep].T) * dh**-0.5
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        return p @ v[0, :, h // rep]

    return jax.lax.map(head, jnp.arange(q.shape[2])).transpose(1, 0, 2)[None]


def _fwd_bwd(fn):
    """jit of (q, k, v, seg, dy) -> (out, (dq, dk, dv)) of `fn(q, k, v, seg)`."""
    import jax

    def run(q, k, v, seg, dy):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return out, vjp(dy.astype(out.dtype))

    return jax.jit(run)


def _time(fn, args, warmup: int, runs: int) -> float:
    """Median seconds of `fn(*args)` after `warmup` untimed calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _parity(a, b) -> dict:
    """Relative max errors of outputs and of each gradient of result `a` against result `b`."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    grad = max(_rel_err(ga, gb) for ga, gb in zip(grads_a, grads_b))
    out = _rel_err(out_a, out_b)
    return {"out": out, "grad": grad, "ok": out <= ATTN_TOL["out"] and grad <= ATTN_TOL["grad"]}


def _compiled(fn, args):
    """(compiled program, its temp bytes from XLA's memory analysis, None where not reported)."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    return compiled, (None if mem is None else int(mem.temp_size_in_bytes))


def attention_case(length: int, samples: int, heads, impls, warmup: int, runs: int) -> dict:
    """One packed row: each implementation's time, TFLOP/s, temp memory and parity (vs fp32 and vs XLA)."""
    import jax

    from dflop_jax.costs.flops import causal_pairs
    from models.attention import attention

    q, k, v, seg, dy = _attention_inputs(length, samples, heads, np.random.default_rng(length))
    fwd_flops = 4.0 * heads[2] * heads[0] * causal_pairs([length // samples] * samples)
    ref = jax.device_get(_fwd_bwd(_reference_attention)(q, k, v, seg, dy))
    row = {"length": length, "samples": samples, "fwd_flops": fwd_flops, "impls": {}}
    results = {}
    for impl in impls:
        fn = lambda q, k, v, seg, impl=impl: attention(q, k, v, segment_ids=seg, causal=True,  # noqa: E731
                                                       implementation=impl)  # fmt: skip
        fwd, fwd_mem = _compiled(fn, (q, k, v, seg))
        both, both_mem = _compiled(_fwd_bwd(fn), (q, k, v, seg, dy))
        results[impl] = jax.device_get(both(q, k, v, seg, dy))
        t_f = _time(fwd, (q, k, v, seg), warmup, runs)
        t_fb = _time(both, (q, k, v, seg, dy), warmup, runs)
        row["impls"][impl] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "fwd_tflops": fwd_flops / t_f / 1e12,
                              "fwd_bwd_tflops": 3 * fwd_flops / t_fb / 1e12,
                              "fwd_temp_bytes": fwd_mem, "fwd_bwd_temp_bytes": both_mem,
                              "vs_fp32": _parity(results[impl], ref)}  # fmt: skip
    for impl in results:  # a probe of one implementation alone has no XLA result to compare with
        if impl != "xla" and "xla" in results:
            row[f"{impl}_vs_xla"] = _parity(results[impl], results["xla"])
    return row


def attention_impls(info: dict, wanted=()) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the implementations to measure, {implementation: why not} for the others).

    Of `wanted` (() = all): XLA always runs; on a GPU every other implementation the decoder accepts
    (`models.decoder_config.ATTENTION_IMPLS`: cuDNN, and a Pallas kernel where this tree has one)
    that runs a small packed row forward and backward here."""
    from models.decoder_config import ATTENTION_IMPLS

    others = tuple(i for i in ("cudnn", "pallas") if not wanted or i in wanted)
    xla = ["xla"] if not wanted or "xla" in wanted else []
    if not info["gpu"]:
        return tuple(xla), {i: "needs a GPU" for i in others}
    usable, missing = xla, {}
    for impl in others:
        if impl not in ATTENTION_IMPLS:
            missing[impl] = (
                f"not built: not in models.decoder_config.ATTENTION_IMPLS {ATTENTION_IMPLS}"
            )
            continue
        try:
            if impl == "cudnn":  # its paths fall back to Pallas where cuDNN is absent: probe cuDNN
                _probe_cudnn()
            attention_case(256, 2, (4, 2, 64), (impl,), 0, 1)
        except Exception as e:  # the probe's purpose: an implementation that cannot run here
            missing[impl] = (
                f"fails here: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            )
            continue
        usable.append(impl)
    return tuple(usable), missing


def _probe_cudnn() -> None:
    """One bf16 forward and backward of jax's cuDNN attention (raises where cuDNN cannot run)."""
    import jax
    import jax.numpy as jnp

    from models.cudnn_attention import prefix_attention

    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    loss = lambda q: prefix_attention(q, q, q, None, True).astype(jnp.float32).sum()
    jax.block_until_ready(jax.grad(loss)(q))


def attention_part(size: Size, info: dict, warmup: int, runs: int, wanted=()) -> dict:
    """Packed rows at the size's lengths, one sample and `size.attn_packed` samples, per implementation
    of `wanted` (() = all that run here) and XLA, the reference of the parity columns."""
    impls, missing = attention_impls(info, (*wanted, "xla") if wanted else ())
    cases = [attention_case(n, s, size.attn_heads, impls, warmup, runs)
             for n in size.attn_lengths for s in (1, size.attn_packed)]  # fmt: skip
    note = (
        None
        if info["gpu"]
        else "CPU: the cuDNN and (compiled) Pallas paths need a GPU; only the XLA path ran"
    )
    return {"heads": list(size.attn_heads), "tolerance": ATTN_TOL, "impls": list(impls),
            "not_measured": missing, "note": note, "cases": cases}  # fmt: skip
