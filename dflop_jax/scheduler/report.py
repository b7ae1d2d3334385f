"""Sample files in, JSON reports out: the `schedule` CLI's I/O, kept beside the scheduler for reuse.

Input (JSON lines): `{"id": ..., "tiles": int, "tokens": int}` (+ optional "modality").
Output: `schedule_to_json` — microbatches with tile/length buckets and per-LLM-shard sample ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dflop_jax.contracts import SampleShape, Schedule


def read_samples_jsonl(path: str | Path) -> list[SampleShape]:
    """Reads sample shapes; a bad line raises ValueError naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"samples file not found: {path}")
    out, seen = [], set()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            sid, tiles, tokens = rec["id"], rec["tiles"], rec["tokens"]
            if not (isinstance(tiles, int) and isinstance(tokens, int)) or tiles < 0 or tokens < 1:
                raise ValueError(
                    f"tiles={tiles!r}, tokens={tokens!r}: need integers, tiles >= 0, tokens >= 1"
                )
            modality = str(rec.get("modality", "text" if tiles == 0 else "image"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(
                f'{path}:{lineno}: bad sample line ({what}); expected {{"id": ..., "tiles": int, "tokens": int}}'
            ) from None
        if sid in seen:
            raise ValueError(f"{path}:{lineno}: duplicate sample id {sid!r}")
        seen.add(sid)
        out.append(SampleShape(sid, tiles, tokens, modality))
    if not out:
        raise ValueError(f"{path}: no samples")
    return out


def schedule_to_json(schedule: Schedule, shapes: Sequence[SampleShape]) -> dict:
    """JSON-able report with sample ids (not indices) and per-microbatch real loads."""
    mbs = []
    for mb in schedule.microbatches:
        mbs.append(
            {
                "tile_bucket": mb.tile_bucket,
                "length_bucket": mb.length_bucket,
                "shards": [[shapes[i].id for i in shard] for shard in mb.shards],
                "shard_tokens": [sum(shapes[i].tokens for i in shard) for shard in mb.shards],
                "tiles": sum(shapes[i].tiles for i in mb.samples()),
            }
        )
    info = {
        k: v
        for k, v in schedule.info.items()
        if isinstance(v, (int, float, str, bool)) or v is None
    }
    return {
        "microbatches": mbs,
        "objective": schedule.objective,
        "lower_bound": schedule.lower_bound,
        "gap": schedule.gap,
        "solver": schedule.solver,
        "time_s": schedule.time_s,
        **{k: v for k, v in info.items() if k not in ("microbatches",)},
        "num_microbatches": len(mbs),
    }
