"""Run metrics: one JSON line per step (`run_dir/metrics.jsonl`), a live console line, TensorBoard.

Definitions (DESIGN section 9): tokens/s counts real LLM tokens (no padding); MFU = model FLOPs of the
real work / (step time x devices x peak FLOP/s), the peak being the run device's preset figure
(`costs.device_specs`, `device.peak_flops` to override); padding ratio = 1 - real / computed per module (stage_padding_ratio:
the same per stage, as every stage of a module runs its bucket shapes). A stage that runs the colocated
encoder (COLOCATED, `stage_modules`) computes both: `stage_padding` reports its tiles and its tokens
separately (the tile bucket and the length bucket pad independently), and the console shows the tile
padding beside the token padding of any run that encodes tiles. Steps that measured
stage times (the scheduler's adaptive correction) add pred_raw_mape / pred_corrected_mape: the stage-time
prediction error before and after correction. A run that measures drift (`planner.replan_every`)
adds plan_regret to the row read after each measurement.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from dflop_jax.data.sample_arrays import GlobalBatch

# (row key, column name, format): the console line names each column it shows.
CONSOLE_COLUMNS = (
    ("loss", "loss", "{:.4f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("lr", "lr", "{:.2e}"),
    ("step_time_s", "step time", "{:.2f}s"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("mfu", "MFU", "{:.2%}"),
    ("llm_padding_ratio", "padding", "{:.1%}"),
    ("tile_padding_ratio", "tile padding", "{:.1%}"),
    ("audio_padding_ratio", "audio padding", "{:.1%}"),
    ("data_wait_s", "data wait", "{:.2f}s"),
    ("microbatches", "microbatches", "{:d}"),
    ("recompiles", "compiles", "{:d}"),
    ("eval_loss", "eval loss", "{:.4f}"),
    ("plan_regret", "plan regret", "{:.1%}"),
)


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One optimizer step's record (a `metrics.jsonl` line; module docstring for the definitions).

    Attributes:
      step, loss, grad_norm, lr: the update.
      step_time_s, tokens_per_s, samples_per_s, mfu: throughput (real tokens/samples; one MFU,
        `dflop_jax.costs.flops.mfu`).
      llm_padding_ratio, encoder_padding_ratio, stage_padding_ratio: padding per module / per stage
        (stage_padding_ratio: of a stage's main work, the colocated stage's tokens).
      stage_padding: per stage, the padding of each thing it computes: {"tiles": r} (encoder stage),
        {"audio": r} (audio stage: its frames),
        {"tokens": r} (LLM stage), {"tiles": r, "tokens": r} (the colocated stage).
      tile_padding_ratio: the tile padding of a run whose stages encode tiles (console "tile
        padding"), None without an encoder.
      audio_padding_ratio: of the audio frames the audio encoder ran (each LLM row's audio row),
        the share that was padding (console "audio padding"); None when the step ran no audio.
      microbatches, loss_tokens, skipped: the global batch.
      scheduler_latency_s, scheduler_gap, scheduler_solver, predicted_step_time_s: the schedule.
      data_wait_s: time the step waited for the loader.
      compiles, recompiles: executables the run has built so far in this process / while this step
        was dispatched (`runtime/precompile.py`: 0 when every program was compiled ahead).
      stage_times_measured: this step timed its stage programs (adaptive correction).
      pred_raw_mape, pred_corrected_mape: recent-window stage-time prediction error (out of sample)
        of the cost model and of the corrected one (None before any observation).
      correction_observations, correction_active, new_observations: the correction's state as the
        batch was scheduled (with the observations of steps <= step - 1 - prefetch).
      dispatch_s: host seconds the trainer spent issuing the step (it does not wait for it).
      dispatch_cpu_s: CPU seconds of the dispatching thread in that time (its own work: Python and
        jax's dispatch; dispatch_s adds what it waited for, e.g. cores busy running programs).
      dispatch_programs, dispatch_stage_programs, dispatch_transfer_programs,
        dispatch_update_programs: programs the step issued, all and by kind (`programs/dispatch.py`:
        stage programs, transfer programs, the update's programs).
      dispatch_us_per_program, dispatch_cpu_us_per_program: dispatch_s and dispatch_cpu_s per
        program issued, in microseconds.
      dispatch_first_wait_s: seconds from the dispatch's start to the first time it waited on a
        device (a measured step's sampled microbatch); dispatch_s when it never waited.
      wall_s: seconds between the previous step's end and this one's (its data wait included when
        the batch was late); step_time_s leaves a late batch's wait out.
      update_skipped: the loss or the gradients were not finite: the update was skipped on device.
      skipped_steps: updates skipped so far in the run.
      eval_loss, eval_tokens, eval_recompiles: steps that evaluated (`eval.every`): the held-out
        loss after this step's update (loss sum / loss tokens), its loss tokens, and the programs
        that evaluation compiled (None on other steps).
      plan_regret, plan_regret_step: a drift measurement (`planner.replan_every`,
        `planner/drift.py`) over the global batches through step plan_regret_step: how much longer
        the running plan's expected step time is than the best plan's the planner finds for them
        (0.25: the best takes 20% less); on the first row read after the measurement finished
        (None on other rows).
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    llm_padding_ratio: float
    encoder_padding_ratio: float
    stage_padding_ratio: list[float]
    microbatches: int
    loss_tokens: int
    scheduler_latency_s: float
    scheduler_gap: float
    scheduler_solver: str
    data_wait_s: float
    predicted_step_time_s: float
    compiles: int
    recompiles: int
    skipped: int
    stage_times_measured: bool
    pred_raw_mape: float | None
    pred_corrected_mape: float | None
    correction_observations: int
    correction_active: bool
    new_observations: int
    dispatch_s: float = 0.0
    dispatch_cpu_s: float = 0.0
    dispatch_programs: int = 0
    dispatch_stage_programs: int = 0
    dispatch_transfer_programs: int = 0
    dispatch_update_programs: int = 0
    dispatch_us_per_program: float = 0.0
    dispatch_cpu_us_per_program: float = 0.0
    dispatch_first_wait_s: float = 0.0
    wall_s: float = 0.0
    update_skipped: bool = False
    skipped_steps: int = 0
    eval_loss: float | None = None
    eval_tokens: int | None = None
    eval_recompiles: int | None = None
    stage_padding: list[dict[str, float]] = dataclasses.field(default_factory=list)
    tile_padding_ratio: float | None = None
    audio_padding_ratio: float | None = None
    plan_regret: float | None = None
    plan_regret_step: int | None = None


# `stage_modules` name of a stage that runs the colocated encoder and LLM layers in one program.
COLOCATED = "encoder+llm"


def stage_modules(layout, multimodal: bool) -> list[str]:
    """What each stage of `layout` computes: "encoder", "audio", "llm", or COLOCATED for LLM stage 0
    of an MLLM layout without encoder stages (the runtime's `stage_builder.colocated`)."""
    colocated, first = multimodal and not layout.encoder_stages, layout.first_llm
    return [COLOCATED if colocated and i == first else s.module
            for i, s in enumerate(layout.stages)]  # fmt: skip


def step_metrics(
    step: int,
    batch: GlobalBatch,
    stage_modules: Sequence[str],
    correction: dict[str, Any],
    *,
    observed_before: int,
    **update: Any,
) -> StepMetrics:
    """The record of one step: `update` (loss, grad_norm, lr, step_time_s, mfu, compiles, recompiles,
    stage_times_measured), the batch's stats and schedule, and the scheduler's `prediction_error()`
    (`correction`; `observed_before`: its observation count before this step). `stage_modules`:
    per stage "encoder", "audio", "llm" or COLOCATED (`stage_modules()`)."""
    st, schedule, time_s = batch.stats, batch.schedule, update["step_time_s"]
    tiles, tokens = st.encoder_padding_ratio, st.llm_padding_ratio
    audio = st.packed.audio_padding_ratio if st.packed.audio_frames_computed else None
    pads = {"encoder": {"tiles": tiles}, "llm": {"tokens": tokens}, "audio": {"audio": audio},
            COLOCATED: {"tiles": tiles, "tokens": tokens}}  # fmt: skip
    encodes = any(m not in ("llm", "audio") for m in stage_modules)
    return StepMetrics(
        step=step,
        tokens_per_s=st.packed.tokens_real / time_s,
        samples_per_s=st.num_samples / time_s,
        llm_padding_ratio=st.llm_padding_ratio,
        encoder_padding_ratio=st.encoder_padding_ratio,
        # Every stage of a module computes the same bucket shapes: its module's padding ratio.
        stage_padding_ratio=[
            {"encoder": tiles, "audio": audio}.get(m, tokens) for m in stage_modules
        ],
        stage_padding=[pads[m] for m in stage_modules],
        tile_padding_ratio=tiles if encodes else None,
        audio_padding_ratio=audio,
        microbatches=len(batch.microbatches),
        loss_tokens=batch.num_loss_tokens,
        scheduler_latency_s=st.scheduler_latency_s,
        scheduler_gap=schedule.gap,
        scheduler_solver=schedule.solver,
        data_wait_s=st.data_wait_s,
        predicted_step_time_s=schedule.objective,
        skipped=st.num_skipped,
        pred_raw_mape=correction["raw_mape"],
        pred_corrected_mape=correction["corrected_mape"],
        correction_observations=correction["observations"],
        correction_active=correction["active"],
        new_observations=correction["observations"] - observed_before,
        **update,
    )


def dispatch_metrics(
    seconds: float, cpu_s: float, issued: Sequence[int], first_wait_s: float | None
) -> dict[str, Any]:
    """The `StepMetrics` dispatch fields of a step issued in `seconds` (wall; `cpu_s` of the
    dispatching thread) that issued `issued` programs per kind (stage, transfer, update:
    `programs.dispatch.KINDS`) and first waited on a device `first_wait_s` after its start (None:
    never)."""
    n = sum(issued)
    stage, moved, update = issued
    return dict(
        dispatch_s=seconds, dispatch_cpu_s=cpu_s, dispatch_programs=n,
        dispatch_stage_programs=stage, dispatch_transfer_programs=moved,
        dispatch_update_programs=update,
        dispatch_us_per_program=seconds / n * 1e6 if n else 0.0,
        dispatch_cpu_us_per_program=cpu_s / n * 1e6 if n else 0.0,
        dispatch_first_wait_s=seconds if first_wait_s is None else first_wait_s,
    )  # fmt: skip


def real_work(batch: GlobalBatch, has_encoder: bool) -> list[tuple[int, int]]:
    """(tiles, tokens) of a global batch's real work for MFU (`costs.batch_model_flops`), as
    scheduled: per microbatch its samples' tiles, and each sample's tokens (the whole batch on every
    host, whichever rows this host packed)."""
    work = []
    for plan in batch.schedule.microbatches:
        samples = [batch.shapes[i] for shard in plan.shards for i in shard]
        if has_encoder:
            work.append((sum(s.tiles for s in samples), 0))
        work += [(0, s.tokens) for s in samples]
    return work


def real_audio_windows(batch: GlobalBatch) -> list[int]:
    """The valid frames of every audio window of a global batch's samples, as scheduled (MFU's
    audio work, `costs.batch_model_flops`)."""
    return [w for plan in batch.schedule.microbatches for shard in plan.shards for i in shard
            for w in batch.shapes[i].audio_windows]  # fmt: skip


class MetricsLog:
    """Writes per-step metrics to JSONL (+ TensorBoard) and prints a console line every `every` steps."""

    def __init__(
        self,
        run_dir: str | Path,
        every: int,
        tensorboard: bool,
        console: Console | None = None,
        process: int = 0,
        total_steps: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        name = "metrics.jsonl" if process == 0 else f"metrics.process{process}.jsonl"
        self.path = Path(run_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self.every = every
        self.console = console or Console()
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        self.history: list[StepMetrics] = []
        self.progress = Progress(total_steps, clock)

    def log(self, metrics: StepMetrics) -> None:
        self.history.append(metrics)
        row = dataclasses.asdict(metrics)
        self._file.write(json.dumps(row, default=_jsonable) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, row["step"])
        self.progress.tick(row["step"], compiled=row["recompiles"] > 0)
        if row["step"] % self.every == 0 or row["step"] == 1 or row["eval_loss"] is not None:
            self.console.print(console_line(row, self.progress), highlight=False, soft_wrap=True)

    def summary(self, skip_first: int = 1) -> dict[str, Any]:
        """Means over the steps after the first `skip_first` (compile steps), plus totals."""
        rows = self.history[skip_first:] or self.history
        if not rows:
            return {}

        def mean(k):
            return float(np.mean([getattr(r, k) for r in rows]))

        first, last = self.history[0], self.history[-1]
        evals = [r for r in self.history if r.eval_loss is not None]
        return {
            "steps": last.step,
            "first_loss": first.loss,
            "final_loss": last.loss,
            "step_time_s_mean": mean("step_time_s"),
            "tokens_per_s_mean": mean("tokens_per_s"),
            "samples_per_s_mean": mean("samples_per_s"),
            "mfu_mean": mean("mfu"),
            "llm_padding_ratio_mean": mean("llm_padding_ratio"),
            "scheduler_latency_s_mean": mean("scheduler_latency_s"),
            "data_wait_s_mean": mean("data_wait_s"),
            # Host time issuing a step, per program issued (`programs/dispatch.py`): wall and the
            # dispatching thread's CPU time.
            "dispatch_s_mean": mean("dispatch_s"),
            "dispatch_programs_mean": mean("dispatch_programs"),
            "dispatch_us_per_program_mean": mean("dispatch_us_per_program"),
            "dispatch_cpu_us_per_program_mean": mean("dispatch_cpu_us_per_program"),
            "predicted_step_time_s_mean": mean("predicted_step_time_s"),
            "skipped_samples": sum(r.skipped for r in self.history),
            # Adaptive correction at the end of the run: stage-time MAPE of the raw cost model and
            # of the corrected one (recent window, out of sample), and the microbatches observed.
            "pred_raw_mape": last.pred_raw_mape,
            "pred_corrected_mape": last.pred_corrected_mape,
            "correction_observations": last.correction_observations,
            **({"final_eval_loss": evals[-1].eval_loss} if evals else {}),
        }

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """Step k/N, elapsed wall time and an ETA from the mean wall time of the steps that compiled nothing.

    Compile steps (the first, and any that traced a new bucket program) take many times a steady
    step, so they are left out of the mean; until a steady step is seen the ETA is unknown.
    """

    def __init__(self, total_steps: int | None, clock: Callable[[], float] = time.monotonic):
        self.total = total_steps
        self.clock = clock
        self.start = self._last = clock()
        self.step = 0
        self._steady: list[float] = []

    def tick(self, step: int, compiled: bool) -> None:
        """Records that `step` finished now (`compiled`: it built new programs)."""
        now = self.clock()
        if not compiled and self.step:  # the first step of a (resumed) run includes setup
            self._steady.append(now - self._last)
        self.step, self._last = step, now

    @property
    def elapsed_s(self) -> float:
        return self._last - self.start

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the mean steady step time; None before a steady step (or without N)."""
        if self.total is None or not self._steady:
            return None
        return max(self.total - self.step, 0) * float(np.mean(self._steady))

    def describe(self) -> str:
        of = f"/{self.total}" if self.total is not None else ""
        eta = self.eta_s
        return (
            f"step {self.step}{of} | elapsed {_clock_time(self.elapsed_s)} | "
            f"ETA {_clock_time(eta) if eta is not None else '?'}"
        )


def console_line(row: dict[str, Any], progress: Progress) -> str:
    """`step k/N | elapsed | ETA | loss 2.3456 | grad norm 0.812 | ...`: every value after its name."""
    parts = [progress.describe()]
    for key, name, fmt in CONSOLE_COLUMNS:
        if row.get(key) is not None:  # columns a run does not produce are left out
            parts.append(f"{name} {fmt.format(row[key])}")
    return " | ".join(parts)


def _clock_time(seconds: float) -> str:
    """h:mm:ss (or m:ss under an hour)."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)
