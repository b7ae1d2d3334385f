"""A step's metrics row for the tests of the console line and metrics.jsonl (`runtime/metrics.py`)."""

from dflop_jax.runtime.metrics import StepMetrics


def step_metrics(step: int, recompiles: int) -> StepMetrics:
    """One step's metrics row with fixed numbers (no eval, no measured stage times)."""
    return StepMetrics(
        step=step,
        loss=2.34567,
        grad_norm=0.8123,
        lr=3e-3,
        step_time_s=1.5,
        tokens_per_s=1234.4,
        samples_per_s=10.0,
        mfu=0.125,
        llm_padding_ratio=0.1,
        encoder_padding_ratio=0.2,
        stage_padding_ratio=[0.2, 0.1],
        microbatches=4,
        loss_tokens=500,
        scheduler_latency_s=0.003,
        scheduler_gap=0.01,
        scheduler_solver="greedy",
        data_wait_s=0.012,
        predicted_step_time_s=1.4,
        compiles=3,
        recompiles=recompiles,
        skipped=0,
        stage_times_measured=False,
        pred_raw_mape=None,
        pred_corrected_mape=None,
        correction_observations=0,
        correction_active=False,
        new_observations=0,
    )
