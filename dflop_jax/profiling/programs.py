"""The programs the model profiler compiles and times: the runtime's own stage programs, one part at a time.

A part (STAGE_KINDS) or a whole stage (`StageShape`) at (tp, bucket) is a runtime `StageSpec` on a
("data", "model") = (1, tp) mesh. Its programs come from the runtime's one builder
(`programs.stage_builder.abstract_stage` -> `programs.stage_jits.stage_jits`), so what is timed is what trains:
  forward:  `StageJits.forward` (on the LLM head part: forward + loss, without gradients), or under a
            saving residual policy ("all", "layers") `StageJits.forward_residuals` (the forward that
            also returns its residuals)
  backward: `StageJits.backward` (recompute the forward under `jax.vjp`, add dL/dparams into a donated
            fp32 accumulator), under a saving policy `StageJits.backward_residuals` (the backward from
            those residuals, no forward), or on the LLM head part `StageJits.last` (forward + loss +
            backward fused, as the last pipeline stage trains).
Under a training recipe (`trainable`, costs/recipe.py) a part's programs are the ones it runs under
that recipe, as the trainer builds them (`runtime.train_state.trained_mask`, and the part's role,
`costs.recipe.stage_role`: an input gradient iff a part before it in the model trains; the colocated
stage's role is that of its one program of all three parts): a frozen part behind a trained one
has a dx-only backward, a frozen part with nothing trained before it NO backward (`bwd` None: it runs
forward only), a trained part with nothing trained before it computes no dx.
This file only supplies the inputs: abstract ones to compile from and random real ones to time with,
shaped and typed as the data layer packs a microbatch (`data.packing.pack_microbatch`, fields chosen by
`StageFns.fields` as the runtime places them) and as the previous stage hands over its output.

Shapes per dp shard (bucket b): encoder kinds take T = b tiles (pixels [T,H,W,3] for the embedding,
hidden [T,N,Dv] otherwise); LLM kinds take one packed row of S = b tokens ([1,S] ids, [1,S,D] hidden).
The LLM embedding part places image features of F = max(1, S // (2 tokens_per_tile)) tiles per row
(half the row as image tokens, a typical mix), packed by row as the trainer packs them (each row's
block padded to a multiple of tp: `contracts.row_tile_slots`), through the exact feature taps when
the model family packs them (LLaVA-OV, as `data.loader.pack_taps` does).

Audio kinds (a model with an audio encoder) take per data shard one packed audio row of A = b mel
frames (the audio features [1,A,M] for the embedding, hidden [1,A/2,Da] otherwise), its windows of at
most 30 s (the encoder's longest) back to back, every frame valid: the rows an audio stage encodes
and LLM stage 0 encodes when it runs the audio encoder.

The colocated stage (`tile_bucket` given: `models.mllm.ColocatedStage`, built by
`abstract_stage(..., colocated=True)` as the trainer builds it) takes per data shard T tiles and one
row of S tokens, packed `tiles_by_row` (row r's tiles in its own shard's slots); the row's second half
places features of its own tiles (up to T tiles' worth), as the packer writes a colocated microbatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts import ScheduledMicrobatch, row_tile_slots
from dflop_jax.contracts.layout import StageSpec
from dflop_jax.costs.recipe import TRAINABLE_PARTS, stage_role
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.data.sample_arrays import FEATURE_TAPS, TEXT, plain_taps
from dflop_jax.programs.param_paths import trained_mask
from dflop_jax.programs.stage_builder import (
    abstract_stage,
    has_encoder,
    has_vision,
    holds_audio,
    stage_config,
    takes_audio,
)
from dflop_jax.programs.stage_fns import boundary_shape, signature
from dflop_jax.programs.stage_jits import stage_jits
from dflop_jax.programs.trees import compute_structs, copied_leaves


@dataclasses.dataclass(frozen=True)
class PartProgram:
    """The runtime's programs of one part (or stage) at one shape, with inputs to compile and time.

    Attributes:
      mesh: the (1, tp) mesh the programs run on.
      fwd: fwd(params, x, side); bwd: bwd(params, x, side, seed, gacc) with `gacc` donated, None when
        the part runs forward only under its recipe.
      params_abs, x_abs, side_abs, seed_abs, gacc_abs: abstract (ShapeDtypeStruct with sharding) arguments
        (params_abs: the parameters' compute-dtype copies, as the trainer's programs take them); x_abs
        is None when the part takes no activation (the encoder embedding reads its tiles from side);
        seed_abs is the backward's seed: gy = dL/dy for inner parts, the loss normalizer for the head;
        gacc_abs the per-replica gradient accumulator's buffers (`programs.accumulator`).
      make_params(rng): real (random) sharded params; make_inputs(rng) -> (x, side, seed) real arrays.
      trained: bool per leaf of params_abs, whether the recipe trains it (None: all).
      jits: all the stage's programs (`programs.stage_jits.StageJits`), e.g. the residual-saving pair.
      master_abs: the fp32 master parameters the stage holds beside `params_abs` (None: the same).
    """

    mesh: Mesh
    fwd: Callable
    bwd: Callable | None
    params_abs: Any
    x_abs: Any
    side_abs: dict
    seed_abs: Any
    gacc_abs: Any
    make_params: Callable[[np.random.Generator], Any]
    make_inputs: Callable[[np.random.Generator], tuple]
    trained: Any = None
    jits: Any = None
    master_abs: Any = None

    @property
    def masters(self) -> Any:
        """The fp32 master parameters' structs (`master_abs`, else `params_abs`)."""
        return self.params_abs if self.master_abs is None else self.master_abs

    @property
    def copy_bytes(self) -> float:
        """Bytes per device of the compute-dtype weight copies the stage holds beside its masters:
        the leaves its programs take in another dtype than the masters' (none at fp32 compute)."""
        pairs = zip(jax.tree.leaves(self.params_abs), jax.tree.leaves(self.masters))
        return per_device_bytes([c for c, m in pairs if c.dtype != m.dtype])


def profile_mesh(devices, tp: int) -> Mesh:
    """A (1, tp) Auto-axis ("data", "model") mesh on the first tp devices."""
    grid = np.array(list(devices)[:tp], dtype=object).reshape(1, tp)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass(frozen=True)
class StageShape:
    """What one program computes: a module's layer count with or without its embedding / head.

    A table part is a StageShape with one component (`part_shape`); the cost-model benchmark builds
    whole stages (several components in one program) to check the sum-of-parts prediction.
    """

    module: str  # "encoder" | "llm" | "audio"
    layers: int
    has_embedding: bool = False
    has_head: bool = False

    def spec(self, tp: int) -> StageSpec:
        """The runtime stage of this shape (first layer 0, one data-parallel replica)."""
        return StageSpec(self.module, 0, self.layers, tp=tp, dp=1,
                         has_embedding=self.has_embedding, has_head=self.has_head)  # fmt: skip


def part_shape(kind: str, layers: int) -> StageShape:
    module, part = kind.split("_", 1)
    return StageShape(
        module, layers if part == "layers" else 0, part == "embedding", part == "head"
    )


def _feature_tiles(model_cfg, bucket: int) -> int:
    """Tiles per row whose features fill half the row's `bucket` tokens (0 without vision)."""
    if not has_vision(model_cfg):
        return 0
    return max(1, bucket // (2 * model_cfg.tokens_per_tile))


def _audio_tower(model_cfg):
    """The Whisper config of the model's audio encoder (omni or Qwen2-Audio)."""
    from models.stage_modules import audio_part

    return audio_part(model_cfg).audio


def _microbatch(
    model_cfg, st, bucket: int, dp: int, features: int, tile_bucket: int | None,
    audio: tuple[int, int] = (0, 0),
) -> dict[str, np.ndarray]:  # fmt: skip
    """An all-padding microbatch of the part's bucket on `dp` data shards, packed by the data layer
    (its shapes, dtypes); an LLM part places the features of `features` tiles per row (packed by
    row, blocks of a multiple of the stage's tp); the colocated stage (`tile_bucket` T) packs T
    tiles per row's shard (`tiles_by_row`). `audio` (A, rows): the microbatch's audio rows of A
    frames, one per LLM row (an audio stage's `bucket` is A; `rows` its LLM rows, default `dp`)."""
    from models.internvl import InternVLConfig

    v = getattr(model_cfg, "vision", None)
    frames, rows = audio
    mels = _audio_tower(model_cfg).num_mel_bins if (frames or st.module == "audio") else 0
    enc = st.module == "encoder"
    if st.module == "audio":  # its rows' audio, a token per row
        plan, enc_dp = ScheduledMicrobatch(0, 1, ((),) * (rows or dp), audio_bucket=bucket), dp
    elif tile_bucket is not None:
        plan, enc_dp = ScheduledMicrobatch(tile_bucket, bucket, ((),) * dp, tiles_by_row=True), dp
    elif enc:
        plan, enc_dp = ScheduledMicrobatch(bucket, 1, ((),) * dp), dp
    else:
        plan = ScheduledMicrobatch(features, bucket, ((),) * dp, tiles_by_row=True, row_align=st.tp)
        enc_dp = 1
    if frames and st.module == "llm":
        plan = dataclasses.replace(plan, audio_bucket=frames)
    taps = 0 if isinstance(model_cfg, InternVLConfig) else FEATURE_TAPS
    tile_shape = (v.image_size, v.image_size, v.num_channels) if v else (1, 1, 3)  # no tile
    mb, _ = pack_microbatch(plan, [], [], encoder_dp=enc_dp, llm_dp=len(plan.shards),
                            tile_shape=tile_shape, tokens_per_tile=_tokens_per_tile(model_cfg),
                            feature_taps=taps, audio_mels=mels)  # fmt: skip
    return dataclasses.asdict(mb)


def _fill(batch: dict[str, np.ndarray], model_cfg, rng: np.random.Generator) -> None:
    """Random pixels and tokens, one sample per row, the second half of the row image features of
    the row's own block of tiles (packed by row, as the trainer packs); audio rows of random
    features, every frame valid, in windows of the encoder's longest."""
    if batch.get("audio") is not None:
        _fill_audio(batch, model_cfg, rng)
    vocab, (rows, length) = _text(model_cfg).vocab_size, batch["tokens"].shape
    tiles = batch["tiles"].shape[0] // rows
    n_features = tiles * _tokens_per_tile(model_cfg)
    batch["tiles"][...] = rng.integers(0, 256, batch["tiles"].shape, np.uint8)  # uint8, as trained
    batch["tokens"][...] = rng.integers(0, vocab, (rows, length))
    batch["targets"][...] = rng.integers(0, vocab, (rows, length))
    batch["segment_ids"][...] = 1
    batch["positions"][...] = np.arange(length)
    batch["loss_mask"][...] = 1
    n = min(length // 2, n_features)
    batch["feature_index"][...] = TEXT
    offset = np.arange(rows)[:, None] * n_features  # global slot rows, as packed
    batch["feature_index"][:, length - n :] = offset + np.arange(n)
    if batch["feature_taps"] is not None:
        k = batch["feature_taps"].shape[-1]
        taps, weights = plain_taps(batch["feature_index"].reshape(-1), k)
        batch["feature_taps"][...] = taps.reshape(rows, length, k)
        batch["feature_weight"][...] = weights.reshape(rows, length, k)


def _fill_audio(batch: dict[str, np.ndarray], model_cfg, rng: np.random.Generator) -> None:
    """Random log-mel-like features; windows of `max_frames` (30 s) numbered from 1, all valid."""
    longest = _audio_tower(model_cfg).max_frames
    frames = batch["audio"].shape[1]
    batch["audio"][...] = rng.standard_normal(batch["audio"].shape)
    batch["audio_windows"][...] = np.arange(frames) // longest + 1
    batch["audio_valid"][...] = True


def _x_shape(model_cfg, st, bucket: int, dp: int, features: int, colocated: bool):
    """(shape, dtype) of the activation the previous stage hands over (None: the pipeline's first
    and an audio branch's first), global over `dp` data shards (an audio stage: its rows); the
    first LLM part's x is the projected features of `features` tiles per row, each row's block
    padded to a multiple of tp (none for the colocated stage: it encodes its tiles itself)."""
    v, t = getattr(model_cfg, "vision", None), _text(model_cfg)
    if colocated:
        return None
    if st.module == "audio":  # the previous audio stage's hidden rows, after the stride-2 conv
        a = _audio_tower(model_cfg)
        return None if st.has_embedding else ((dp, bucket // 2, a.hidden_size), jnp.dtype(a.dtype))
    if st.module == "encoder":
        hidden = (dp * bucket, v.seq_len, v.hidden_size)
        return None if st.has_embedding else (hidden, jnp.dtype(v.dtype))
    if st.has_embedding and v is None:  # tokens only (its audio, if any, comes apart)
        return None
    if st.has_embedding:  # the projector's features, computed in the vision dtype
        tiles = dp * row_tile_slots(features, 1, dp, st.tp)
        return (tiles, model_cfg.tokens_per_tile, t.hidden_size), jnp.dtype(v.dtype)
    return (dp, bucket, t.hidden_size), jnp.dtype(t.dtype)


def _audio_features(model_cfg, dp: int, frames: int):
    """(shape, dtype) of the audio stages' output LLM stage 0 takes: [rows, A/4, D], projected in
    the audio encoder's dtype."""
    a = _audio_tower(model_cfg)
    return (dp, frames // 4, _text(model_cfg).hidden_size), jnp.dtype(a.dtype)


def _text(model_cfg):
    """The decoder's config (a decoder-only model's is the model's own)."""
    return getattr(model_cfg, "text", model_cfg)


def _tokens_per_tile(model_cfg) -> int:
    """LLM tokens per vision tile (1 for a model without vision: it packs no tile)."""
    return getattr(model_cfg, "tokens_per_tile", 1)


def _abstract_x(shapes, x_spec, mesh: Mesh):
    """Abstract x of `shapes` ((shape, dtype), or a dict of them for a joining stage) on the
    stage's x shardings, padded where the devices do not divide (as the transfer delivers it)."""
    if shapes is None:
        return None
    if isinstance(shapes, dict):
        return {k: _abstract_x(v, x_spec[k], mesh) for k, v in shapes.items()}
    sharding = NamedSharding(mesh, x_spec)
    return jax.ShapeDtypeStruct(boundary_shape(shapes[0], sharding), shapes[1], sharding=sharding)


def build_part(
    model_cfg, kind: str, tp: int, bucket: int, layers: int, devices, compute_dtype,
    trainable: Sequence[str] = TRAINABLE_PARTS, residuals: str = "recompute",
) -> PartProgram:  # fmt: skip
    """The profiling programs of one table part under `trainable` and the residual policy
    `residuals` (see the module docstring). Nothing is compiled."""
    st = part_shape(kind, layers)
    return build_program(model_cfg, st, tp, bucket, devices, compute_dtype, trainable, residuals)


def build_colocated(
    model_cfg, tp: int, tile_bucket: int, length: int, devices, compute_dtype,
    trainable: Sequence[str] = TRAINABLE_PARTS, residuals: str = "recompute",
) -> PartProgram:  # fmt: skip
    """The colocated stage's programs with no LLM layer (table kind colocated_embedding: the
    whole encoder + the LLM's embedding and feature placement, `ColocatedStage`) on a (1, tp) mesh
    at `tile_bucket` tiles and a `length`-token row. Nothing is compiled."""
    spec = StageSpec("llm", 0, 0, tp=tp, dp=1, has_embedding=True)
    mesh = profile_mesh(devices, tp)
    return stage_program(model_cfg, spec, mesh, length, compute_dtype, tile_bucket=tile_bucket,
                         trainable=trainable, residuals=residuals)  # fmt: skip


def build_program(
    model_cfg, st: StageShape, tp: int, bucket: int, devices, compute_dtype,
    trainable: Sequence[str] = TRAINABLE_PARTS, residuals: str = "recompute",
) -> PartProgram:  # fmt: skip
    """The runtime's forward / backward programs of `st` on a (1, tp) mesh at `bucket` under
    `trainable` and the residual policy `residuals`, with inputs. Nothing is compiled."""
    mesh = profile_mesh(devices, tp)
    return stage_program(model_cfg, st.spec(tp), mesh, bucket, compute_dtype, trainable=trainable,
                         residuals=residuals)  # fmt: skip


def stage_program(
    model_cfg,
    spec: StageSpec,
    mesh: Mesh,
    bucket: int,
    compute_dtype,
    feature_tiles=None,
    *,
    tile_bucket: int | None = None,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    residuals: str = "recompute",
    audio_bucket: int = 0,
    audio_apart: bool = False,
    audio_rows: int | None = None,
    pooled: bool = False,
) -> PartProgram:
    """The runtime's programs of stage `spec` on its ("data", "model") `mesh` at `bucket` per data
    shard, with inputs. Nothing is compiled.

    Args:
      feature_tiles: tiles per row whose features the first LLM stage of an MLLM receives (each
        row's own, gathered over its tp devices); default half the row's tokens as image tokens.
      tile_bucket: T: `spec` (the first LLM stage) is the colocated stage, at T
        tiles and `bucket` tokens per data shard (the trainer's `colocated` stage program).
      trainable: the recipe's trained parts: the programs the stage runs under it (module docstring;
        its input needs a gradient iff a part before it trains, as `build_stages` decides per stage).
      residuals: the stage's residual policy, as `build_stages` applies it (a "layers" stage is
        built with layer remat); `jits` then holds its residual-saving programs.
      audio_bucket: an omni model's audio frames per LLM row: the first LLM stage runs the audio
        encoder on them (or, `audio_apart`, takes the audio stages' features of them); an audio
        stage's `bucket` is its frames per row and `audio_rows` the LLM rows it encodes (default
        its dp).
      audio_apart: the layout gives the audio encoder stages of its own (`build_stages`).
      pooled: the first LLM stage takes a pooled encoder's features (`Layout.pooled_tiles`):
        `feature_tiles` per row make the pool it gathers whole, each row's taps in its own part.
    """
    model_cfg = stage_config(model_cfg, residuals)
    dp = mesh.shape["data"]
    colocated = tile_bucket is not None
    if colocated and not (spec.module == "llm" and spec.has_embedding):
        raise ValueError(f"tile_bucket={tile_bucket}: only the first LLM stage holds the encoder")
    bp = abstract_stage(model_cfg, spec, mesh, colocated=colocated, audio_apart=audio_apart,
                        pooled=pooled)  # fmt: skip
    mask = trained_mask(bp.state, trainable)
    audio = dict(audio=holds_audio(model_cfg, spec, audio_apart),
                 audio_x=takes_audio(model_cfg, spec, audio_apart))  # fmt: skip
    role = stage_role(spec, trainable, has_encoder(model_cfg), colocated=colocated, **audio)
    jits = stage_jits(mesh, bp.fns, bp.state, compute_dtype, mask, role, residuals)
    # what the trainer's programs take (`StageProgram`)
    copies = compute_structs(
        bp.state, compute_dtype, copied_leaves(bp.state, compute_dtype, mask, bp.gathered)
    )
    head = bp.fns.loss is not None
    data, scalar = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    features = feature_tiles or _feature_tiles(model_cfg, bucket)
    frames = audio_bucket if (audio["audio"] or audio["audio_x"]) else 0
    rows = audio_rows or dp
    batch = _microbatch(model_cfg, spec, bucket, dp, features, tile_bucket, (frames, rows))
    side_abs = {k: _abstract(batch[k], data) for k in bp.fns.fields(batch)}
    x_shapes = _x_shape(model_cfg, spec, bucket, rows if spec.module == "audio" else dp,
                        features, colocated)  # fmt: skip
    if audio["audio_x"]:  # the two branches' outputs, or (colocated, no vision) the audio's
        sound = _audio_features(model_cfg, dp, audio_bucket)
        alone = colocated or not has_vision(model_cfg)
        x_shapes = sound if alone else {"encoder": x_shapes, "audio": sound}
    x_abs = _abstract_x(x_shapes, bp.fns.x_spec, mesh)
    if head:
        seed_abs = jax.ShapeDtypeStruct((), jnp.float32, sharding=scalar)
    else:
        with jax.set_mesh(mesh):
            y = jax.eval_shape(jits.forward, copies, x_abs, side_abs)
        seed_abs = jax.ShapeDtypeStruct(
            y.shape, y.dtype, sharding=NamedSharding(mesh, bp.fns.y_spec)
        )

    def make_params(rng: np.random.Generator):
        # random values are enough for timing; host init + device_put avoids compiling an init program
        def leaf(a):
            return jax.device_put((0.02 * rng.standard_normal(a.shape)).astype(a.dtype), a.sharding)

        return jax.tree.map(leaf, copies)

    def make_inputs(rng: np.random.Generator):
        _fill(batch, model_cfg, rng)
        side = {k: jax.device_put(batch[k], a.sharding) for k, a in side_abs.items()}
        return _random(x_abs, rng), side, _random(seed_abs, rng)

    return PartProgram(mesh, jits.forward, jits.last if head else jits.backward, copies, x_abs,
                       side_abs, seed_abs, list(jits.accumulator.structs), make_params,
                       make_inputs, mask, jits, bp.state)  # fmt: skip


def compile_residual_programs(prog: PartProgram) -> tuple[jax.stages.Compiled, jax.stages.Compiled]:
    """(forward_residuals, backward_residuals) of a saving stage's `prog`, compiled: the backward at
    the residuals' structs `jax.eval_shape` gives and the forward inputs' `signature`, as
    `programs.stage_program.StageProgram.backward_from` calls it."""
    jits, args = prog.jits, (prog.params_abs, prog.x_abs, prog.side_abs)
    with jax.set_mesh(prog.mesh):
        fwd = jits.forward_residuals.lower(*args).compile()
        _, kept = jax.eval_shape(jits.forward_residuals, *args)
        sig = signature(prog.x_abs, prog.side_abs)
        bwd = jits.backward_residuals.lower(
            prog.params_abs, kept, prog.seed_abs, prog.gacc_abs, sig
        ).compile()
    return fwd, bwd


def held_residual_bytes(prog: PartProgram, forward: jax.stages.Compiled) -> float:
    """Bytes per device the driver holds per microbatch from `prog`'s compiled saving `forward`
    until its backward runs (`Held`): the forward's outputs but y (an inner stage's seed dL/dy has
    y's struct), as XLA places them. Not the backward's arguments: jit drops those its program does
    not read (a few % fewer bytes on the tiny LLM stages), and `eval_shape`'s residual structs carry
    no sharding to count them per device."""
    return forward.memory_analysis().output_size_in_bytes - per_device_bytes(prog.seed_abs)


def _abstract(a: np.ndarray, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def _random(a, rng: np.random.Generator):
    """A standard-normal array like `a` (a loss normalizer: positive) on its sharding; a dict of
    them (a joining stage's x) likewise."""
    if a is None:
        return None
    if isinstance(a, dict):
        return {k: _random(v, rng) for k, v in a.items()}
    value = (
        np.abs(rng.standard_normal(a.shape)) + 1 if a.shape == () else rng.standard_normal(a.shape)
    )
    return jax.device_put(np.asarray(value).astype(a.dtype), a.sharding)


def per_device_bytes(tree) -> float:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0.0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += float(np.prod(shape, dtype=np.float64)) * jnp.dtype(a.dtype).itemsize
    return total
