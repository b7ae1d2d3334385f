"""Prediction-error statistics shared by the cost-model benchmarks (`bench costmodel`, `bench gpu`)."""

from __future__ import annotations

import numpy as np


def mape(pred, meas) -> tuple[float, float]:
    """(mean, worst) absolute percentage error of predictions `pred` against measurements `meas`.

    Raises:
      ValueError: no pairs, or a measurement that is not > 0 (a percentage of zero is undefined).
    """
    pred, meas = np.asarray(pred, dtype=np.float64), np.asarray(meas, dtype=np.float64)
    if meas.size == 0 or pred.shape != meas.shape:
        raise ValueError(f"mape: {pred.shape} predictions vs {meas.shape} measurements")
    if not (meas > 0).all():
        raise ValueError("mape: every measurement must be > 0")
    err = np.abs(pred - meas) / meas
    return float(err.mean()), float(err.max())
