"""Flash attention for packed rows as Pallas kernels (Triton on GPU, interpret mode elsewhere).

`pallas_attention(q, k, v, segment_ids, causal)` has the masking semantics of `models.attention`
(a token attends to tokens of its own segment id, earlier-or-equal ones when causal; id 0 is
padding and attends among itself) and GQA (k / v heads shared by groups of query heads).

Why our own kernel and not `jax.experimental.pallas.ops.gpu.attention.mha`: that kernel masks by
segment id but loops over every causal key block, so a row packing 16 samples costs a full causal
square; it also wants as many kv heads as query heads. Here each query block loops only over the
key blocks between the first and last occurrence of its queries' segment ids (and, when causal, up
to its own end), and each key block of the backward only over the matching query blocks: with
contiguous segments a block owned only by other samples is never loaded. The bounds are exact for
any id layout (an id that reappears later in the row widens its range; the mask stays exact).

Kernels (grid axes: block, row, head): forward (online softmax; also writes the float32
log-sum-exp), dq (per query block), dk/dv (per key block and query head; the float32 per-head
partials are summed over each kv group outside the kernel: one [B,S,H,Dh] float32 buffer each,
which the memory model counts as transient). Rows are padded to a multiple of the block with a
fresh segment id and the head dim to a power of two with zeros (no effect on logits or outputs).
Compiled, the tile edge follows the head dim, row length and dtype (`gpu_block`: the shared-memory
budget of a program's q, k and v tiles).

`interpret=None` picks interpret mode unless the default backend is a GPU; `forced_mode` (a
context manager) overrides it, which is how CPU tests lower the real Triton kernels for CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from models.layers import auto_mesh_axes

_NEG = float(jnp.finfo(jnp.float32).min)
GPU_BLOCKS = (128, 64, 32, 16)  # tile edges the compiled kernels choose from (`gpu_block`)
SMEM_BUDGET = 96 * 1024  # bytes of one program's q tile and double-buffered k / v tiles
NUM_STAGES = 2  # Triton software pipelining: loads of the next k / v tiles overlap the current
INTERPRET_BLOCK = 128  # interpret mode pays per grid step, not per flop: fewer, bigger blocks
_FORCED: list[bool] = []  # stack of interpret settings from `forced_mode`


@contextlib.contextmanager
def forced_mode(interpret: bool):
    """Within this block, kernels traced here run interpreted (True) or compile for the GPU (False)."""
    _FORCED.append(interpret)
    try:
        yield
    finally:
        _FORCED.pop()


def _interpret(interpret: bool | None) -> bool:
    if interpret is not None:
        return interpret
    if _FORCED:
        return _FORCED[-1]
    return jax.default_backend() != "gpu"


def head_width(head_dim: int) -> int:
    """The head dim the kernels run at: a power of two >= 16 (Triton's tile sizes), zero-padded."""
    return max(16, pl.next_power_of_2(head_dim))


def gpu_block(head_dim: int, length: int, itemsize: int = 2) -> int:
    """Tile edge (queries and keys alike) of the compiled kernels for rows of `length` tokens.

    Why: a program holds in shared memory its query tile and `NUM_STAGES` buffers of its key and
    value tiles, (block + 2 * NUM_STAGES * block) * W elements of `itemsize` bytes at the padded
    head dim W (`head_width`). The largest of `GPU_BLOCKS` within `SMEM_BUDGET` is taken: a bigger
    tile feeds the tensor cores longer per load and launches fewer programs, and 96 KiB leaves room
    on an A100 (164 KiB a block) for the backward's extra do / dq tiles. bf16 gives 128 at W <= 64,
    64 at W 128 (SigLIP's Dh 72 runs at W 128), 32 at W 256; float32 (parity runs) half those. The
    tile never exceeds the row (rounded up to a power of two). Not yet timed on a GPU.
    """
    width = head_width(head_dim)
    fits = [b for b in GPU_BLOCKS if (1 + 2 * NUM_STAGES) * b * width * itemsize <= SMEM_BUDGET]
    block = fits[0] if fits else GPU_BLOCKS[-1]
    return min(block, pl.next_power_of_2(max(16, length)))


def _compiler_params(width: int, block: int):
    """Triton launch settings (ignored in interpret mode): 8 warps from a [128, 64] tile up (more
    threads for the f32 [block, block] logits and [block, W] accumulator), else 4."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(
        num_warps=8 if block * width >= 128 * 64 else 4, num_stages=NUM_STAGES
    )


# ---- block ranges from segment ids ----


def _occurrence(seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token: index of the first and one past the last token of the row with its id.

    Ids outside [0, S] (never made by the packer) get the whole row: safe, just unskipped."""
    b, s = seg.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    inside = (seg >= 0) & (seg <= s)
    ids = jnp.where(inside, seg, s + 1)
    rows = jnp.arange(b)[:, None]
    first = jnp.full((b, s + 2), s, jnp.int32).at[rows, ids].min(pos)
    last = jnp.full((b, s + 2), 0, jnp.int32).at[rows, ids].max(pos + 1)
    first = jnp.where(inside, jnp.take_along_axis(first, ids, 1), 0)
    last = jnp.where(inside, jnp.take_along_axis(last, ids, 1), s)
    return first, last


def _ranges(first, last, block, lower, upper_limit):
    """[B, n, 2] int32 (lo, hi) block ranges: per block of `block` tokens, the blocks holding the
    tokens any of its tokens pairs with (`first` / `last` from `_occurrence`), clipped from below
    to `lower(i)` and from above to `upper_limit(i)` (the causal bounds)."""
    b, s = first.shape
    n = s // block
    lo = first.reshape(b, n, block).min(-1) // block
    hi = -(-last.reshape(b, n, block).max(-1) // block)
    i = jnp.arange(n)
    lo = jnp.maximum(lo, lower(i))
    hi = jnp.minimum(hi, upper_limit(i))
    return jnp.stack([lo, hi], -1).astype(jnp.int32)


def block_ranges(segment_ids: jax.Array, block: int, causal: bool):
    """(key-block range per query block, query-block range per key block): [B, n, 2] each."""
    first, last = _occurrence(segment_ids)
    n = segment_ids.shape[1] // block
    zero, full = (lambda i: 0), (lambda i: n)
    keys = _ranges(first, last, block, zero, (lambda i: i + 1) if causal else full)
    queries = _ranges(first, last, block, (lambda i: i) if causal else zero, full)
    return keys, queries


def visited_blocks(segment_ids: jax.Array, block: int, causal: bool) -> jax.Array:
    """Key blocks the forward loads, summed over query blocks: [B] int32 (for the bench)."""
    keys, _ = block_ranges(segment_ids, block, causal)
    return jnp.maximum(keys[..., 1] - keys[..., 0], 0).sum(-1)


# ---- kernels (one program: one block of one row and one head) ----


def _mask(seg_ref, r0, rows, c0, cols, causal):
    """[rows, cols] allowed pairs of the tile whose rows start at r0 and columns at c0."""
    mask = seg_ref[pl.ds(r0, rows)][:, None] == seg_ref[pl.ds(c0, cols)][None, :]
    if causal:
        mask &= (r0 + jnp.arange(rows))[:, None] >= (c0 + jnp.arange(cols))[None, :]
    return mask


def _dot(a, b, trans_b=False):
    """a @ b (or a @ b.T) accumulated in f32. Float32 operands multiply in full precision: Triton
    would take TF32 for the default precision (ignoring `jax.default_matmul_precision`), and f32 runs
    are the parity runs."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    full = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=full, preferred_element_type=jnp.float32)


def _forward_kernel(rng_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, block):
    q0 = pl.program_id(0) * block
    q = q_ref[...]

    def visit(j, carry):
        m, denom, acc = carry
        k0 = j * block
        kj, vj = k_ref[pl.ds(k0, block), :], v_ref[pl.ds(k0, block), :]
        mask = _mask(seg_ref, q0, block, k0, block, causal)
        logits = jnp.where(mask, _dot(q, kj, trans_b=True) * scale, _NEG)
        m_new = jnp.maximum(m, logits.max(-1))
        p = jnp.where(mask, jnp.exp(logits - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + _dot(p.astype(vj.dtype), vj)
        return m_new, denom * corr + p.sum(-1), acc

    init = (
        jnp.full((block,), _NEG, jnp.float32),
        jnp.zeros((block,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(rng_ref[0], rng_ref[1], visit, init)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)  # every query sees itself: denom > 0
    lse_ref[...] = m + jnp.log(denom)


def _probs_and_ds(q, do, kj, vj, lse, delta, mask, scale):
    """FlashAttention-2 backward tile: (p, dS) float32 [rows, cols] from the saved log-sum-exp."""
    p = jnp.where(mask, jnp.exp(_dot(q, kj, trans_b=True) * scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, vj, trans_b=True) - delta[:, None]) * scale
    return p, ds


def _dq_kernel(
    rng_ref,
    seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    scale,
    causal,
    block,
):
    q0 = pl.program_id(0) * block
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def visit(j, dq):
        k0 = j * block
        kj, vj = k_ref[pl.ds(k0, block), :], v_ref[pl.ds(k0, block), :]
        mask = _mask(seg_ref, q0, block, k0, block, causal)
        _, ds = _probs_and_ds(q, do, kj, vj, lse, delta, mask, scale)
        return dq + _dot(ds.astype(kj.dtype), kj)

    dq = jax.lax.fori_loop(rng_ref[0], rng_ref[1], visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    rng_ref,
    seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    causal,
    block,
):
    k0 = pl.program_id(0) * block
    kj, vj = k_ref[...], v_ref[...]

    def visit(i, carry):
        dk, dv = carry
        q0 = i * block
        rows = pl.ds(q0, block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        mask = _mask(seg_ref, q0, block, k0, block, causal)
        p, ds = _probs_and_ds(q, do, kj, vj, lse_ref[rows], delta_ref[rows], mask, scale)
        dv = dv + _dot(p.T.astype(do.dtype), do)
        return dk + _dot(ds.T.astype(q.dtype), q), dv

    zeros = jnp.zeros(kj.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(rng_ref[0], rng_ref[1], visit, (zeros, zeros))
    dk_ref[...] = dk
    dv_ref[...] = dv


# ---- pallas_call wrappers: arrays [B, S, heads, Dh], grid (blocks, B, H) ----


def _specs(s, dh, block, group):
    """BlockSpecs: a block of one head's rows, a kv head's whole row, per-head rows of lse-like
    [B,H,S] arrays, the range of this block, the row's segment ids."""
    return dict(
        tile=pl.BlockSpec((None, block, None, dh), lambda i, b, h: (b, i, h, 0)),
        row=pl.BlockSpec((None, s, None, dh), lambda i, b, h: (b, 0, h, 0)),
        kv_row=pl.BlockSpec((None, s, None, dh), lambda i, b, h: (b, 0, h // group, 0)),
        kv_tile=pl.BlockSpec((None, block, None, dh), lambda i, b, h: (b, i, h // group, 0)),
        stat_tile=pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i)),
        stat_row=pl.BlockSpec((None, None, s), lambda i, b, h: (b, h, 0)),
        rng=pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0)),
        seg=pl.BlockSpec((None, s), lambda i, b, h: (b, 0)),
    )


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, dh, block, name):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(dh, block),
        name=name,
    )


def _backward(causal, block, interpret, scale_dh, res, dout):
    q, k, v, seg, out, lse = res
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    group = h // kvh
    sp = _specs(s, dh, block, group)
    keys, queries = block_ranges(seg, block, causal)
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
    params = dict(scale=scale_dh**-0.5, causal=causal, block=block)
    grid = (s // block, b, h)
    dq = _call(
        functools.partial(_dq_kernel, **params),
        grid,
        [sp["rng"], sp["seg"], sp["tile"], sp["kv_row"], sp["kv_row"], sp["tile"]]
        + [sp["stat_tile"], sp["stat_tile"]],
        sp["tile"],
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret,
        dh,
        block,
        "packed_flash_dq",
    )(keys, seg, q, k, v, dout, lse, delta)
    per_head = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    dk, dv = _call(
        functools.partial(_dkv_kernel, **params),
        grid,
        [sp["rng"], sp["seg"], sp["row"], sp["kv_tile"], sp["kv_tile"], sp["row"]]
        + [sp["stat_row"], sp["stat_row"]],
        [sp["tile"], sp["tile"]],
        (per_head, per_head),
        interpret,
        dh,
        block,
        "packed_flash_dkv",
    )(queries, seg, q, k, v, dout, lse, delta)
    dk, dv = (x.reshape(b, s, kvh, group, dh).sum(3).astype(k.dtype) for x in (dk, dv))
    return dq, dk, dv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, seg, causal, block, interpret, scale_dh):
    return _flash_fwd(q, k, v, seg, causal, block, interpret, scale_dh)[0]


def _flash_fwd(q, k, v, seg, causal, block, interpret, scale_dh):
    out, lse = _forward(q, k, v, seg, causal, block, interpret, scale_dh)
    return out, (q, k, v, seg, out, lse)


def _forward(q, k, v, seg, causal, block, interpret, scale_dh):
    """(out, float32 log-sum-exp [B,H,S]); the softmax scale is that of the unpadded head dim."""
    b, s, h, dh = q.shape
    sp = _specs(s, dh, block, h // k.shape[2])
    keys, _ = block_ranges(seg, block, causal)
    kernel = functools.partial(_forward_kernel, scale=scale_dh**-0.5, causal=causal, block=block)
    return _call(
        kernel,
        (s // block, b, h),
        [sp["rng"], sp["seg"], sp["tile"], sp["kv_row"], sp["kv_row"]],
        [sp["tile"], sp["stat_tile"]],
        (q, jax.ShapeDtypeStruct((b, h, s), jnp.float32)),
        interpret,
        dh,
        block,
        "packed_flash_forward",
    )(keys, seg, q, k, v)


_flash.defvjp(_flash_fwd, _backward)


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    causal: bool,
    *,
    block: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """q [B,S,H,Dh], k / v [B,S,K,Dh] (H % K == 0) -> [B,S,H,Dh] in q.dtype.

    `block` (a power of two >= 16, Triton's smallest dot) is the tile edge of queries and keys
    alike; rows are padded to a multiple of it. Default: `gpu_block` compiled (by head dim, row
    length and dtype), `INTERPRET_BLOCK` interpreted, either at most the row's length rounded up
    to a power of two."""
    interpret = _interpret(interpret)
    if block is None and interpret:
        block = min(INTERPRET_BLOCK, pl.next_power_of_2(max(16, q.shape[1])))
    elif block is None:
        block = gpu_block(q.shape[-1], q.shape[1], q.dtype.itemsize)
    if block < 16 or block & (block - 1):
        raise ValueError(f"pallas attention block={block} must be a power of two >= 16")
    b, s, h, dh = q.shape
    seg = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    extra = -s % block
    width = head_width(dh)
    if extra or width != dh:
        widen = ((0, 0), (0, extra), (0, 0), (0, width - dh))
        q, k, v = (jnp.pad(x, widen) for x in (q, k, v))
    if extra:
        fresh = jnp.max(seg, axis=1, keepdims=True) + 1
        seg = jnp.concatenate([seg, jnp.broadcast_to(fresh, (b, extra))], axis=1)

    def kernel(q, k, v, seg):
        return _flash(q, k, v, seg, causal, block, interpret, dh)

    out = _per_head_shard(kernel, q, k, v, seg)
    return out[:, :s, :, :dh]


def _per_head_shard(kernel, q, k, v, seg):
    """`kernel(q, k, v, seg)` on each device's heads (and rows) where the mesh shards them.

    A Pallas call is opaque to GSPMD, which would gather every head onto every device of the
    "model" axis and run the whole attention on each; heads are independent, so a `shard_map` over
    the head (and batch) axes runs each device's own. Query and kv heads split alike keep each
    query head's kv head local (contiguous groups)."""
    heads, kv_heads = auto_mesh_axes("act_heads"), auto_mesh_axes("act_kv_heads")
    mesh = jax.sharding.get_abstract_mesh()
    size = math.prod(mesh.shape[a] for a in heads)
    if not heads or heads != kv_heads or size == 1 or q.shape[2] % size or k.shape[2] % size:
        return kernel(q, k, v, seg)
    rows = auto_mesh_axes("batch")
    if q.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = ()
    row_spec = (rows[0] if len(rows) == 1 else rows) if rows else None
    head_spec = heads[0] if len(heads) == 1 else heads
    spec = P(row_spec, None, head_spec, None)
    return jax.shard_map(
        kernel,
        in_specs=(spec, spec, spec, P(row_spec, None)),
        out_specs=spec,
        axis_names=set(heads) | set(rows),
        check_vma=False,
    )(q, k, v, seg)
