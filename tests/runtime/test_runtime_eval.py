"""Held-out evaluation (`eval.*`): the split is deterministic and disjoint from training; the eval
loss of a pipelined run equals a single-device forward of the unsplit model over the same held-out
samples (float32); evaluations compile nothing after the first and evaluate the same batches; the
loss is in metrics.jsonl and the checkpoint; evaluating changes no training loss; bad eval keys are
one-line config errors."""

import dataclasses
import io
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from metrics_fixtures import step_metrics
from models_fixtures import tiny_decoder_run
from multiprocess_launch import decoder_args, finish, launch, rows
from rich.console import Console

from dflop_jax.config import ConfigError, load_config
from dflop_jax.data import load_source, load_tokenizer
from dflop_jax.data.loader import Loader
from dflop_jax.data.split import split_records
from dflop_jax.programs.param_paths import key_name
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.runtime import evaluate
from dflop_jax.runtime.checkpoint import SavedState, model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.metrics import MetricsLog
from dflop_jax.train import run
from models.decoder import Decoder
from models.loss import cross_entropy_sum

REPO = Path(__file__).resolve().parents[2]


def test_split_is_deterministic_disjoint_and_keyed_by_id():
    records = [{"id": f"r{i}", "text": "x"} for i in range(2000)] + [{"text": "no id"}] * 50
    train, held = split_records(records, 0.2, seed=3)
    again_train, again_held = split_records(records, 0.2, seed=3)
    assert held == again_held and train == again_train
    ids = {r["id"] for r in held if "id" in r}
    assert not ids & {r["id"] for r in train if "id" in r}
    assert len(train) + len(held) == len(records)
    assert 0.15 < len(held) / len(records) < 0.25  # 2050 uniform draws at 0.2
    # Another seed, another split; a duplicate of a held-out id is held out wherever it sits.
    assert {r["id"] for r in split_records(records, 0.2, seed=4)[1] if "id" in r} != ids
    dup = next(iter(held))
    shuffled = [dup, *records[::-1]]
    held_again = split_records(shuffled, 0.2, seed=3)[1]
    assert sum(r is dup for r in held_again) == 2
    assert {r["id"] for r in held_again if "id" in r} == ids  # reordering keeps the split
    assert split_records(records, 0.0, seed=3) == (records, [])


def _tb_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the TensorBoard event files under `directory` (TFRecord framing:
    length, its crc, an `Event` proto, its crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for path in directory.rglob("*tfevents*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_eval_loss_in_console_jsonl_and_tensorboard(tmp_path):
    """An evaluating step's row prints even off the log cadence, with its eval loss, and the loss
    reaches metrics.jsonl, TensorBoard and the summary; other rows carry none."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    log = MetricsLog(tmp_path, 10, True, console, total_steps=10)
    log.log(step_metrics(1, recompiles=3))
    log.log(
        dataclasses.replace(
            step_metrics(2, 0), eval_loss=1.23456, eval_tokens=77, eval_recompiles=0
        )
    )
    log.log(step_metrics(3, recompiles=0))
    log.close()
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 2 and "eval loss" not in lines[0]
    assert lines[1].startswith("step 2/10") and lines[1].endswith("| eval loss 1.2346")
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_loss"] for r in rows] == [None, 1.23456, None]
    assert rows[1]["eval_tokens"] == 77
    tb = _tb_scalars(tmp_path / "tb")
    assert tb["eval_loss"] == {2: pytest.approx(1.23456)} and set(tb["loss"]) == {1, 2, 3}
    assert log.summary()["final_eval_loss"] == 1.23456


def _cfg(tmp_path, name, **over):
    over = {"layout.microbatches": "[1, 6]", "measure_stage_times_every": 0, "steps": 4,
            "eval.fraction": 0.3, **over}  # fmt: skip
    return load_config(TrainConfig, None, tiny_decoder_run(tmp_path, name, 64, **over))


class _Seen:
    """The sample ids every training / eval loader yields, and the eval microbatches."""

    def __init__(self, monkeypatch):
        self.train, self.evals, self.eval_batches = [], [], []
        real_next, real_make = Loader.__next__, evaluate.make_loader

        def next_(loader):
            batch = real_next(loader)
            if getattr(loader, "for_eval", False):
                self.evals.append(batch.stats.sample_ids)
                self.eval_batches[-1].append(batch.microbatches)
            else:
                self.train.append(batch.stats.sample_ids)
            return batch

        def make(*args, **kwargs):
            loader = real_make(*args, **kwargs)
            loader.for_eval = True
            self.eval_batches.append([])  # one list per evaluation
            return loader

        monkeypatch.setattr(Loader, "__next__", next_)
        monkeypatch.setattr(evaluate, "make_loader", make)


def _reference_model(model_cfg, stages, layout):
    """The unsplit decoder (one device) holding the pipelined stages' parameters."""
    with jax.default_device(jax.devices()[0]):
        decoder = Decoder(model_cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(decoder)
    tree = model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    flat = {
        tuple(key_name(k) for k in path if key_name(k) != "value"): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree["llm"]["params"])[0]
    }
    pure = jax.tree_util.tree_map_with_path(
        lambda path, _: jnp.asarray(flat[tuple(key_name(k) for k in path)[1:]]),
        nnx.to_pure_dict(state),
    )
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _reference_eval_loss(model, microbatches) -> float:
    """sum of cross-entropy sums / sum of loss tokens, forward only, on one device."""

    @jax.jit
    def loss_sum(mb):
        h = model.embed(mb["tokens"])
        logits = model.forward_embeddings(h, mb["segment_ids"], mb["positions"])
        return cross_entropy_sum(logits, mb["targets"], mb["loss_mask"])[0]

    total = tokens = 0.0
    for mb in microbatches:
        arrays = {k: getattr(mb, k) for k in ("tokens", "segment_ids", "positions", "targets")}
        arrays["loss_mask"] = mb.loss_mask
        total += float(loss_sum(arrays))
        tokens += float(mb.loss_mask.sum())
    return total / tokens


def _dispatch_thread_placements(monkeypatch) -> list:
    """Stages whose side inputs the main (dispatch) thread copied to their devices."""
    on_main, real_put = [], StageProgram.put_side

    def put_side(stage, batch):
        if threading.current_thread() is threading.main_thread():
            on_main.append(stage)
        return real_put(stage, batch)

    monkeypatch.setattr(StageProgram, "put_side", put_side)
    return on_main


def test_eval_loss_matches_reference_and_training_never_sees_eval_records(tmp_path, monkeypatch):
    seen = _Seen(monkeypatch)
    on_main = _dispatch_thread_placements(monkeypatch)
    cfg = _cfg(tmp_path, "eval", **{"eval.every": 2, "checkpoint.every": 4})
    report = run(cfg)
    # Training's and evaluation's side inputs went to the devices from the loaders' threads.
    assert on_main == []

    # The held-out records (the split of data.source) are all the evaluator sees; training none.
    records = load_source(cfg.data, cfg.seed)
    held = {r["id"] for r in split_records(records, cfg.eval.fraction, cfg.eval.seed)[1]}
    trained = {i for ids in seen.train for i in ids}
    evaluated = [set(ids) for ids in seen.evals]
    assert trained and not trained & held
    assert evaluated and set().union(*evaluated) <= held
    assert len(seen.train) == cfg.steps  # the evaluations took no training batch

    rows = [json.loads(r) for r in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["eval_loss"] is not None for r in rows] == [False, True, False, True]
    first, second = rows[1], rows[3]
    # Both evaluations ran every full eval batch (one pass: 19 or so records, 2 batches of 8) ...
    assert len(seen.eval_batches) == 2 and len(seen.eval_batches[0]) == len(held) // 8
    # ... the same batches (same schedules, same arrays); evaluation's programs were compiled
    # before step 1 with training's, so neither evaluation compiled anything.
    for a, b in zip(*seen.eval_batches, strict=True):
        assert len(a) == len(b)
        for ma, mb in zip(a, b):
            np.testing.assert_array_equal(ma.tokens, mb.tokens)
    assert first["eval_recompiles"] == 0 and second["eval_recompiles"] == 0
    assert second["eval_loss"] < first["eval_loss"]  # training on the rest generalizes a little

    # The last evaluation equals the unsplit model's forward loss over the same samples.
    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    model_cfg = cfg.model.model_config(
        vocab, tile_px=cfg.data.tile_px, patch_size=cfg.data.patch_size, compute_dtype="float32"
    )
    model = _reference_model(model_cfg, report.stages, report.layout)
    mbs = [mb for batch in seen.eval_batches[-1] for mb in batch]
    np.testing.assert_allclose(second["eval_loss"], _reference_eval_loss(model, mbs), rtol=1e-5)
    assert second["eval_tokens"] == int(sum(mb.loss_mask.sum() for mb in mbs))

    # Saved with the checkpoint of step 4; in the summary.
    reader = SavedState(tmp_path / "eval" / "checkpoints", 4)
    try:
        assert reader.meta["eval"] == {
            "step": 4,
            "loss": second["eval_loss"],
            "tokens": second["eval_tokens"],
        }
    finally:
        reader.close()
    assert report.summary["final_eval_loss"] == second["eval_loss"]
    # evaluation's programs and the checkpoint's compiled before step 1 with the rest
    assert report.summary["programs_after_precompile"] == 0

    # Evaluating changes nothing of training: the same split without evaluations trains alike.
    plain = run(_cfg(tmp_path, "plain"))
    assert plain.losses == report.losses

    # Exact resume with evaluations: 2 steps, stop, resume to 4 == straight, evaluations included.
    over = {"eval.every": 2, "checkpoint.every": 2}
    half = run(_cfg(tmp_path, "resume", steps=2, **over))
    resumed = run(_cfg(tmp_path, "resume", **over))
    assert resumed.first_step == 2 and half.losses + resumed.losses == report.losses
    assert resumed.summary["programs_after_precompile"] == 0  # a resumed run compiles ahead too
    again = [
        json.loads(r) for r in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in rows]


# The demo's LLaVA-OV-style model on two explicit 8-device layouts: 2 encoder stages + 1 LLM stage, or
# the encoder colocated on the first of 2 LLM stages.
MLLM = ["plan=explicit", "layout.llm_tp=[2]", "layout.llm_dp=2",
        "layout.tiles=[16]", "layout.lengths=[1024]", "layout.microbatches=[2, 3]",
        "steps=1", "global_batch=8", "data.synth_samples=32", "checkpoint.every=0",
        "compute_dtype=float32", "measure_stage_times_every=0", "device.peak_flops=1000000000.0",
        "scheduler.solver=greedy", "eval.every=1", "eval.fraction=0.3", "eval.batches=1"]  # fmt: skip
SEPARATE = ["layout.encoder_layers=[1, 1]", "layout.encoder_tp=[1]", "layout.encoder_dp=2",
            "layout.llm_layers=[4]"]  # fmt: skip
COLOCATED = ["layout.encoder_colocated=true", "layout.encoder_layers=[]", "layout.encoder_tp=[]",
             "layout.llm_layers=[2, 2]"]  # fmt: skip


@pytest.mark.slow
def test_multimodal_eval_loss_is_the_same_on_separate_and_colocated_encoders(tmp_path):
    """The forward wave through encoder stages (tiles on the first, features passed on) and through
    the colocated stage give one eval loss: the same held-out samples, the same parameters (a step at
    lr 1e-12 leaves them at the shared init to float32 round-off)."""
    demo = REPO / "configs" / "demo.yaml"
    losses = []
    for name, layout in (("separate", SEPARATE), ("colocated", COLOCATED)):
        over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / name}",
                "compilation_cache=", "optimizer.lr=1.0e-12"]  # fmt: skip
        report = run(load_config(TrainConfig, demo, MLLM + layout + over))
        assert len(report.layout.encoder_stages) == (2 if name == "separate" else 0)
        row = rows(tmp_path / name / "metrics.jsonl")[-1]
        assert row["eval_tokens"] > 0 and np.isfinite(row["eval_loss"])
        assert row["eval_recompiles"] == 0  # every bucket pair's programs compiled before step 1
        losses.append(row["eval_loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.multiprocess
def test_two_processes_read_the_same_eval_loss_as_one(tmp_path):
    """One stage per process: each dispatches only its own stage's programs, and both read the
    loss the last stage computed; equal to the same run in one process."""
    extra = ["scheduler.solver=greedy", "steps=2", "eval.every=2", "eval.fraction=0.3",
             "layout.microbatches=[1, 6]"]  # fmt: skip
    run_dir = tmp_path / "mp"
    logs = tmp_path / "logs"
    logs.mkdir()
    finish(launch(logs, 2, decoder_args(tmp_path, run_dir) + extra))
    got = [rows(run_dir / name)[-1] for name in ("metrics.jsonl", "metrics.process1.jsonl")]
    assert got[0]["step"] == got[1]["step"] == 2
    assert got[0]["eval_loss"] == got[1]["eval_loss"] and got[0]["eval_tokens"] > 0
    one = decoder_args(tmp_path, tmp_path / "sp") + extra + ["num_cpu_devices=8"]
    single = run(load_config(TrainConfig, REPO / "configs" / "demo.yaml", one))
    np.testing.assert_allclose(got[0]["eval_loss"], single.summary["final_eval_loss"], rtol=1e-5)


def test_too_few_held_out_records_is_a_config_error(tmp_path):
    cfg = _cfg(tmp_path, "few", **{"eval.every": 2, "eval.fraction": 0.01, "layout.llm_dp": 1})
    with pytest.raises(ConfigError, match=r"^eval.fraction=0.01: \d held-out records"):
        run(cfg)


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval.every=5"], "eval.every=5: evaluation needs held-out data"),
        (["eval.fraction=1.0"], "eval.fraction=1.0: use 0 (hold nothing out)"),
        (["eval.batches=-2"], "eval.batches=-2: 0 (every full batch"),
        (["eval.source=no/such/eval.jsonl"], "eval.source='no/such/eval.jsonl': file not found"),
        (["eval.every=two"], "eval.every: expected an integer"),
    ],
)
def test_bad_eval_keys_are_one_line_config_errors(args, message):
    env = {**os.environ, "JAX_PLATFORMS": "no_such_platform", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "dflop_jax.train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: " + message), out.stderr
