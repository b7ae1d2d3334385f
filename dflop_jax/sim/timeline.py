"""Timeline plot of a simulated step: one row per stage, a box per forward (F) and backward (B) op."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dflop_jax.sim.pipeline import SimResult

_COLORS = {"F": "#4c72b0", "B": "#dd8452"}


def plot_timeline(
    result: SimResult,
    path: str | Path,
    title: str = "",
    stage_names: Sequence[str] | None = None,
) -> Path:
    """Writes a PNG of `result` to `path`: stage 0 on top, time in ms on x, boxes labelled F<k>/B<k>.

    Args:
      result: the simulated step.
      path: output PNG file (parent directories are created).
      title: figure title; the step time and idle fraction are appended.
      stage_names: optional per-stage row labels (default "stage s").
    Returns:
      The path written.
    """
    import matplotlib  # imported here: the planner imports sim and should not pay for matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    p = result.num_stages
    names = list(stage_names) if stage_names is not None else [f"stage {s}" for s in range(p)]
    if len(names) != p:
        raise ValueError(f"stage_names has {len(names)} entries for {p} stages")
    scale = 1e3  # seconds -> ms
    width = min(max(8.0, 0.25 * 2 * result.num_microbatches), 24.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 1.5))
    label_min = 0.012 * result.step_time  # only label boxes wide enough to read
    for s, stage_events in enumerate(result.events):
        y = p - 1 - s
        for e in stage_events:
            dur = e.end - e.start
            ax.broken_barh(
                [(e.start * scale, dur * scale)],
                (y - 0.4, 0.8),
                facecolors=_COLORS[e.kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if dur >= label_min:
                ax.text(
                    (e.start + dur / 2) * scale,
                    y,
                    f"{e.kind}{e.microbatch}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    ax.set_yticks(range(p))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, result.step_time * scale * 1.01)
    ax.set_title(
        f"{title + ' — ' if title else ''}{result.schedule}: step {result.step_time * scale:.1f} ms, "
        f"idle {result.idle_fraction:.1%}"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
