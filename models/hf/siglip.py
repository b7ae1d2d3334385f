"""HF SigLIP vision weights <-> `models.vit.VisionStage` (import and export), plus the small mapping
toolkit the other vision mappings (`internvl.py`, `llava_onevision.py`) reuse.

A mapping is a list of `Entry(hf_key, path, to_ours, to_hf)`: `path` is the parameter's path in the
nnx state, `to_ours` turns the HF array into our layout, `to_hf` back. Import checks every HF key is
used or explicitly ignored and every parameter is filled with the right shape, and raises one error
listing all problems.

Key prefixes differ between checkpoints (`vision_model.` in google/siglip-*, none in transformers 5
`SiglipVisionModel.save_pretrained`, `vision_tower.vision_model.` in llava-hf checkpoints), so the
vision keys here are relative: callers strip their prefix first (`strip_prefix`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.siglip import SiglipConfig
from models.vit import ViTConfig

Path = tuple


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_key: str
    path: Path
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def same(x: np.ndarray) -> np.ndarray:
    return x


def linear_in(d: int, h: int, dh: int) -> tuple[Callable, Callable]:
    """torch Linear [H*Dh, D] <-> ours [D, H, Dh]."""
    return (lambda w: w.T.reshape(d, h, dh)), (lambda w: w.reshape(d, h * dh).T)


def linear_out(d: int, h: int, dh: int) -> tuple[Callable, Callable]:
    """torch Linear [D, H*Dh] <-> ours [H, Dh, D]."""
    return (lambda w: w.T.reshape(h, dh, d)), (lambda w: w.reshape(h * dh, d).T)


def heads_vec(h: int, dh: int) -> tuple[Callable, Callable]:
    """[H*Dh] <-> [H, Dh]."""
    return (lambda b: b.reshape(h, dh)), (lambda b: b.reshape(h * dh))


def transpose() -> tuple[Callable, Callable]:
    return (lambda w: w.T), (lambda w: w.T)


def patch_conv(cfg: ViTConfig) -> tuple[Callable, Callable]:
    """torch conv [D, C, P, P] <-> ours [P*P*C, D] (rows ordered py, px, c as `models.vit.patchify`)."""
    p, c, d = cfg.patch_size, cfg.num_channels, cfg.hidden_size
    return (
        (lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * c, d)),
        (lambda w: w.reshape(p, p, c, d).transpose(3, 2, 0, 1)),
    )


def prefixed(entries: Iterable[Entry], hf_prefix: str, path_prefix: Path) -> list[Entry]:
    return [
        dataclasses.replace(e, hf_key=hf_prefix + e.hf_key, path=path_prefix + e.path)
        for e in entries
    ]


def strip_prefix(
    tensors: Mapping[str, np.ndarray], rules: list[tuple[str, str]]
) -> dict[str, np.ndarray]:
    """Renames keys with the first matching (regex, replacement) rule; keys matching none are kept."""
    out = {}
    for key, value in tensors.items():
        for pattern, repl in rules:
            new, n = re.subn(pattern, repl, key, count=1)
            if n:
                key = new
                break
        out[key] = value
    return out


def assign(
    module: nnx.Module,
    entries: list[Entry],
    tensors: Mapping[str, np.ndarray],
    *,
    ignore: Callable[[str], bool] = lambda key: False,
    what: str = "model",
    shardings: Mapping[Path, jax.sharding.Sharding] | None = None,
) -> None:
    """Fills every parameter of `module` (real, or abstract from `nnx.eval_shape`) from HF `tensors`.

    Each array goes from host memory straight to its sharding when `shardings` ({param path:
    Sharding}, e.g. from `nnx.get_named_sharding`) is given, else to the default device. Raises
    ValueError listing unused HF keys (not `ignore`d), missing keys, shape mismatches and parameters
    no entry fills.
    """
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    by_key = {e.hf_key: e for e in entries}
    filled = {e.path for e in entries}
    problems = [
        f"unsupported key {k}" for k in sorted(tensors) if k not in by_key and not ignore(k)
    ]
    problems += [f"missing key {k}" for k in sorted(by_key) if k not in tensors]
    problems += [f"no entry fills {'/'.join(map(str, p))}" for p in params if p not in filled]
    updates = []
    for key, entry in by_key.items():
        if entry.path not in params:
            problems.append(f"entry {key} -> {entry.path} names no parameter")
        if key not in tensors or entry.path not in params:
            continue
        current = params[entry.path].get_value()
        value = entry.to_ours(np.asarray(tensors[key]))
        if tuple(value.shape) != tuple(current.shape):
            problems.append(f"shape mismatch {key}: file {value.shape} vs model {current.shape}")
            continue
        updates.append((entry.path, value.astype(current.dtype)))
    if problems:
        more = f"; ... {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"cannot load {what}: " + "; ".join(problems[:20]) + more)
    for path, value in updates:
        placed = jax.device_put(value, shardings[path]) if shardings else jnp.asarray(value)
        params[path].set_value(placed)


def export(module: nnx.Module, entries: list[Entry]) -> dict[str, np.ndarray]:
    """HF-layout arrays {hf_key: np.ndarray} of `module`'s parameters."""
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    return {
        e.hf_key: np.ascontiguousarray(e.to_hf(np.asarray(params[e.path][...]))) for e in entries
    }


def siglip_config_from_hf(d: Mapping, **overrides) -> SiglipConfig:
    """`SiglipVisionConfig` dict (config.json or its vision_config) -> `SiglipConfig`."""
    act = d.get("hidden_act", "gelu_pytorch_tanh")
    acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ValueError(
            f"SigLIP hidden_act={act!r} is not supported; expected one of {sorted(acts)}"
        )
    return SiglipConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        image_size=d["image_size"],
        patch_size=d["patch_size"],
        num_channels=d.get("num_channels", 3),
        norm_eps=d.get("layer_norm_eps", 1e-6),
        act=acts[act],
        **overrides,
    )


def siglip_entries(
    cfg: ViTConfig, *, first_layer: int, num_layers: int, embedding: bool, head: bool
) -> list[Entry]:
    """Entries of a SigLIP `VisionStage` (HF keys relative to `vision_model.`)."""
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    qi, qo = linear_in(d, h, dh)
    oi, oo = linear_out(d, h, dh)
    bi, bo = heads_vec(h, dh)
    ti, to = transpose()
    out: list[Entry] = []
    if embedding:
        pi, po = patch_conv(cfg)
        out += [
            Entry("embeddings.patch_embedding.weight", ("patch_kernel",), pi, po),
            Entry("embeddings.patch_embedding.bias", ("patch_bias",), same, same),
            Entry("embeddings.position_embedding.weight", ("pos_embed",), same, same),
        ]
    for i in range(num_layers):
        k, p = f"encoder.layers.{first_layer + i}.", ("layers", i)
        for n in ("q", "k", "v"):
            out.append(Entry(f"{k}self_attn.{n}_proj.weight", (*p, "attn", f"{n}_kernel"), qi, qo))
            out.append(Entry(f"{k}self_attn.{n}_proj.bias", (*p, "attn", f"{n}_bias"), bi, bo))
        out += [
            Entry(f"{k}self_attn.out_proj.weight", (*p, "attn", "o_kernel"), oi, oo),
            Entry(f"{k}self_attn.out_proj.bias", (*p, "attn", "o_bias"), same, same),
            Entry(f"{k}mlp.fc1.weight", (*p, "mlp", "fc1"), ti, to),
            Entry(f"{k}mlp.fc1.bias", (*p, "mlp", "fc1_bias"), same, same),
            Entry(f"{k}mlp.fc2.weight", (*p, "mlp", "fc2"), ti, to),
            Entry(f"{k}mlp.fc2.bias", (*p, "mlp", "fc2_bias"), same, same),
        ]
        for j in (1, 2):
            out.append(Entry(f"{k}layer_norm{j}.weight", (*p, f"norm{j}", "scale"), same, same))
            out.append(Entry(f"{k}layer_norm{j}.bias", (*p, f"norm{j}", "bias"), same, same))
    if head and cfg.post_norm:
        out += [
            Entry("post_layernorm.weight", ("post_norm", "scale"), same, same),
            Entry("post_layernorm.bias", ("post_norm", "bias"), same, same),
        ]
    return out


# Checkpoint prefixes of the vision keys: google/siglip-* (`vision_model.`), transformers 5 saves (none).
SIGLIP_VISION_PREFIXES = [(r"^vision_model\.", "")]


def is_unused_siglip_key(key: str) -> bool:
    """Keys a vision-only load leaves out on purpose: the text tower, logit scale/bias, pooling head."""
    return key.startswith(
        ("text_model.", "logit_scale", "logit_bias", "head.", "vision_model.head.")
    )
