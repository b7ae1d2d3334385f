"""A tiny stand-in encoder + LLM split into stages, for runtime tests (pure jnp, explicit shardings).

Not a real model: patch-linear encoder with residual tp-sharded MLP layers, a projector, token embedding
with feature placement by `feature_index`, residual MLP LLM layers and an LM head with cross-entropy.
It has the same stage interfaces (side inputs, activations, shardings) as the real model stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.stage_fns import StageFns
from dflop_jax.programs.stage_program import StageProgram

PATCH, IMG, DE, D, F, V = 2, 4, 8, 16, 32, 24
TOKENS_PER_TILE = (IMG // PATCH) ** 2


def _mlp(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def _init(rng, shape, scale=0.3):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def init_params(spec: StageSpec, seed: int) -> tuple[dict, dict]:
    """Stage params and their PartitionSpecs (layer keys are global layer indices)."""
    rng = np.random.default_rng(seed)
    width = DE if spec.module == "encoder" else D
    params, specs = {}, {}
    for layer in spec.layers:
        params[f"layer_{layer:02d}"] = {"w1": _init(rng, (width, F)), "w2": _init(rng, (F, width))}
        specs[f"layer_{layer:02d}"] = {"w1": P(None, "model"), "w2": P("model", None)}
    if spec.module == "encoder":
        if spec.has_embedding:
            params["patch"] = {"w": _init(rng, (PATCH * PATCH * 3, DE)), "b": _init(rng, (DE,))}
            specs["patch"] = {"w": P(), "b": P()}
        if spec.has_head:
            params["proj"] = {"w": _init(rng, (DE, D))}
            specs["proj"] = {"w": P(None, "model")}
    else:
        if spec.has_embedding:
            params["embed"] = _init(rng, (V, D))
            params["newline"] = _init(rng, (D,))
            specs["embed"], specs["newline"] = P(None, "model"), P()
        if spec.has_head:
            params["head"] = _init(rng, (D, V))
            specs["head"] = P(None, "model")
    return params, specs


def stage_fns(spec: StageSpec, first_in_pipeline: bool) -> StageFns:
    layer_keys = [f"layer_{i:02d}" for i in spec.layers]

    def body(p, h):
        for k in layer_keys:
            h = _mlp(p[k], h)
        return h

    if spec.module == "encoder":

        def forward(p, x, side):
            if spec.has_embedding:
                t = side["tiles"]  # [Bt, IMG, IMG, 3]
                bt = t.shape[0]
                t = t.reshape(bt, IMG // PATCH, PATCH, IMG // PATCH, PATCH, 3).transpose(
                    0, 1, 3, 2, 4, 5
                )
                x = (
                    t.reshape(bt, TOKENS_PER_TILE, PATCH * PATCH * 3) @ p["patch"]["w"]
                    + p["patch"]["b"]
                )
            h = body(p, x)
            return h @ p["proj"]["w"] if spec.has_head else h

        keys = ("tiles",) if spec.has_embedding else ()
        return StageFns(
            forward=forward, side_keys=keys, x_spec=None if first_in_pipeline else P("data")
        )

    def embed(p, x, side):
        if not spec.has_embedding:
            return x
        fi = side["feature_index"]
        h = p["embed"][side["tokens"]]
        if x is not None:
            feats = x.reshape(-1, x.shape[-1])  # [Bt * TOKENS_PER_TILE, D]
            h = jnp.where((fi >= 0)[..., None], feats[jnp.clip(fi, 0)], h)
        return jnp.where((fi == -2)[..., None], p["newline"].astype(h.dtype), h)

    side = ("tokens", "feature_index") if spec.has_embedding else ()
    if spec.has_embedding and first_in_pipeline:
        x_spec = None
    elif spec.has_embedding:
        x_spec = P()  # features replicated over the LLM mesh: any row may gather any tile
    else:
        x_spec = P("data")
    if spec.has_head:

        def loss(p, x, side_):
            h = body(p, embed(p, x, side_))
            logits = (h @ p["head"]).astype(jnp.float32)
            lse = jax.nn.logsumexp(logits, axis=-1)
            tgt = jnp.take_along_axis(logits, side_["targets"][..., None], axis=-1)[..., 0]
            mask = side_["loss_mask"]
            return jnp.sum((lse - tgt) * mask), jnp.sum(mask)

        return StageFns(loss=loss, side_keys=side + ("targets", "loss_mask"), x_spec=x_spec)
    return StageFns(forward=lambda p, x, s: body(p, embed(p, x, s)), side_keys=side, x_spec=x_spec)


def stage_seed(spec: StageSpec) -> int:
    return 17 * spec.first_layer + (1000 if spec.module == "llm" else 0)


def build_stages(layout: Layout, meshes, compute_dtype=jnp.float32, seed: int = 0):
    stages = []
    for i, (spec, mesh) in enumerate(zip(layout.stages, meshes)):
        params, specs = init_params(spec, seed + stage_seed(spec))
        params = jax.tree.map(
            lambda a, s, mesh=mesh: jax.device_put(a, NamedSharding(mesh, s)),
            params,
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        stages.append(StageProgram(mesh, stage_fns(spec, i == 0), params, compute_dtype))
    return stages


def make_microbatch(rng, v_dp, tiles_per_shard, l_dp, length):
    """Random packed microbatch fields (PackedMicrobatch names) with a few image features placed."""
    n_tiles = v_dp * tiles_per_shard
    tokens = rng.integers(0, V, size=(l_dp, length)).astype(np.int32)
    fi = np.full((l_dp, length), -1, np.int32)
    n_feat = n_tiles * TOKENS_PER_TILE
    for r in range(l_dp):
        k = min(n_feat, length // 2)
        fi[r, 1 : 1 + k] = rng.permutation(n_feat)[:k]
        fi[r, 1 + k] = -2
    return {
        "tiles": rng.normal(size=(n_tiles, IMG, IMG, 3)).astype(np.float32),
        "tokens": tokens,
        "feature_index": fi,
        "segment_ids": np.ones((l_dp, length), np.int32),
        "positions": np.tile(np.arange(length, dtype=np.int32), (l_dp, 1)),
        "targets": rng.integers(0, V, size=(l_dp, length)).astype(np.int32),
        "loss_mask": (rng.random((l_dp, length)) < 0.6).astype(np.float32),
    }
