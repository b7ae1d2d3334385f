"""cuDNN's packed (THD) attention for rows of several samples, through jax's private cuDNN module.

This is the one private jax API the project uses (`tests/project/test_no_private_jax.py` allows this
file alone). Why: jax's public `jax.nn.dot_product_attention` gives cuDNN one valid prefix per row
(`query_seq_lengths`); a packed row's samples need cuDNN's ragged layout, segment starts and lengths
per row (`q_offsets` / `kv_offsets` + seq lengths), which only
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` passes on.

Verified against jax's source (jax-ml/jax): the signature
`dot_product_attention(query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
fp8_params, *, scale, mask_type, seed, dropout_rate, qkv_layout, sliding_window_length, use_fp8,
return_residual)` and `MaskType` read the same at the tags jax-v0.10.2 and jax-v0.11.0 (the module
is byte-identical there) and on main at version 0.11.1 (August 2026). `VERIFIED_JAX` is that range;
another jax falls back to the Pallas kernels (`unavailable_reason`). What this module relies on, as
read there:
  - offsets [B, M+1] (each row's segment starts, then -1) and seq lengths [B, M] (-1 for unused
    slots); jax moves them into cuDNN's flat layout (`_fix_seqlen_offsets`), and XLA sets cuDNN's
    padding mask whenever M > 1, so a query sees only the keys of its own [start, start + length),
    causally from the segment's start under a causal mask type.
  - the softmax statistics kept for the backward are [B * M, heads, S] float32: M times a flash
    kernel's per-token log-sum-exp (`costs/memory.py` counts it; hence a small `segment_bound`).
  - up to jax-v0.11.0 the kv offsets are scaled by the QUERY head count (fixed on main by jax-ml/jax
    PR 39521), wrong for grouped-query heads: kv heads are repeated to the query heads, exact on
    every version.
  - jax refuses the packed layout below compute capability 9.0 (Hopper).
Rows are cut into runs of equal segment id, each padding run its own segment, so every position is
written (padding attends within its run: finite, and ignored by the loss). A packed sample is
contiguous (the loader packs them so), hence one run: real tokens see exactly what
`models.attention`'s segment mask lets them see. A row with more runs than
the bound is the caller's to route elsewhere (`models.cudnn_attention`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

VERIFIED_JAX = ((0, 10, 2), (0, 11, 1))  # inclusive: the versions whose source was read
MIN_COMPUTE_CAPABILITY = (9, 0)  # Hopper: jax raises for the packed layout below it
SEGMENT_TOKENS = 256  # the bound allows one segment per this many tokens of the row ...
MAX_SEGMENTS = 64  # ... up to this many (the statistics grow with it)


def version_tuple(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as "0.11.1" or "0.11.1.dev20260808"."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"jax version {version!r} is not of the form MAJOR.MINOR.PATCH")
    major, minor, patch = (int(x) for x in found.groups())
    return major, minor, patch


def version_verified(version: str) -> bool:
    """Whether jax `version` lies in `VERIFIED_JAX`."""
    lo, hi = VERIFIED_JAX
    return lo <= version_tuple(version) <= hi


def capability_tuple(compute_capability: str | None) -> tuple[int, ...] | None:
    """ "9.0" -> (9, 0); None (not a CUDA device) stays None."""
    if not compute_capability:
        return None
    return tuple(int(x) for x in str(compute_capability).split("."))


def unavailable_reason(
    platform: str, compute_capability: str | None, jax_version: str
) -> str | None:
    """Why the packed path cannot run on this backend (None: it can), from the backend's facts."""
    if platform != "gpu":
        return f"cuDNN packed attention needs a CUDA GPU (backend: {platform})"
    cc = capability_tuple(compute_capability)
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        return (
            f"cuDNN packed attention needs compute capability >= 9.0 (Hopper); this GPU has "
            f"{compute_capability or 'none reported'}"
        )
    if not version_verified(jax_version):
        lo, hi = (".".join(map(str, v)) for v in VERIFIED_JAX)
        return (
            f"jax {jax_version} is outside the versions whose private cuDNN signature was verified "
            f"({lo} to {hi}, models/cudnn_packed.py)"
        )
    return None


@functools.cache
def _private_api():
    """(dot_product_attention, MaskType) of jax's private cuDNN module, or the import error's text."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except Exception as e:  # noqa: BLE001 (any failure means: not available)
        return f"jax's private cuDNN module did not import ({type(e).__name__}: {e})"
    return fused.dot_product_attention, fused.MaskType


@functools.cache
def local_unavailable_reason() -> str | None:
    """`unavailable_reason` for this process's first device and jax, then whether the module imports."""
    dev = jax.devices()[0]
    reason = unavailable_reason(
        dev.platform, getattr(dev, "compute_capability", None), jax.__version__
    )
    if reason is None and isinstance(_private_api(), str):
        reason = _private_api()
    return reason


def segment_bound(length: int) -> int:
    """Segments per row the packed call is built for (static: the offsets' shape): one per
    `SEGMENT_TOKENS` tokens, at least 2 (cuDNN's ragged layout needs M > 1), at most
    `MAX_SEGMENTS` (the softmax statistics are M times a flash kernel's)."""
    return max(2, min(MAX_SEGMENTS, length // SEGMENT_TOKENS))


def segment_runs(segment_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs of equal segment id along each row (padding runs included), in cuDNN's packed format.

    Args:
      segment_ids: [B, S] int.
      max_runs: M, the static number of run slots per row.

    Returns:
      (offsets [B, M+1] int32: run starts then -1; lengths [B, M] int32: run lengths then -1;
      runs [B] int32: the runs each row holds, which may exceed M: then only the first M are listed
      and the row cannot take the packed path).
    """
    b, s = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1  # [B,S] run index of each token
    rows = jnp.arange(b)[:, None]
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    starts = jnp.full((b, max_runs), s, jnp.int32).at[rows, run].min(pos, mode="drop")
    lengths = jnp.zeros((b, max_runs), jnp.int32).at[rows, run].add(1, mode="drop")
    used = lengths > 0
    offsets = jnp.concatenate(
        [jnp.where(used, starts, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1
    )
    return offsets, jnp.where(used, lengths, -1), run[:, -1] + 1


def packed_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, causal: bool, max_runs: int
) -> jax.Array:
    """cuDNN attention within each run of equal segment id: q [B,S,H,Dh], k / v [B,S,K,Dh] (bf16 or
    fp16) -> [B,S,H,Dh]. Rows must hold at most `max_runs` runs (`segment_runs`); call only where
    `local_unavailable_reason()` is None."""
    api = _private_api()
    if isinstance(api, str):
        raise RuntimeError(api)
    dot_product_attention, mask_type = api
    group = q.shape[2] // k.shape[2]
    if group > 1:  # exact kv heads on every verified jax (module docstring)
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    offsets, lengths, _ = segment_runs(segment_ids, max_runs)
    return dot_product_attention(
        q, k, v,
        q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=mask_type.PADDING_CAUSAL if causal else mask_type.PADDING,
        qkv_layout="BTNH",
    )  # fmt: skip
