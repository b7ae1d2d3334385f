"""One synthetic dataset written three ways: JSONL + image files, HF-layout parquet shards (images
embedded as HF Image structs {bytes, path}), and WebDataset tar shards.

Shard 0 holds the single-image and text-only rows (`image`: one struct, null on text rows), shard 1
the multi-image and video rows (`image`: a list of structs; videos stay frame folders under the
dataset's folder, named by `video`). The JSONL holds the same records in the same order.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from dflop_jax.data.sources import read_records
from dflop_jax.data.synth import synth_dataset

GROUPS = (("single_image", "text"), ("multi_image", "video"))


def synth_records(out: Path, samples: int, tile: int) -> tuple[Path, list[list[dict]]]:
    """(the synthetic dataset's folder, its records per shard, without internal keys)."""
    mix = synth_dataset(out, samples, "llava-ov", seed=0, tile=tile)
    root = mix.parent
    shards = []
    for names in GROUPS:
        rows = []
        for name in names:
            rows += [
                {k: v for k, v in r.items() if not k.startswith("_")}
                for r in read_records(root / f"{name}.jsonl")
            ]
        shards.append(rows)
    return root, shards


def write_jsonl(shards: list[list[dict]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for rows in shards for r in rows))
    return path


def image_struct(root: Path, name: str) -> dict:
    return {"bytes": (root / name).read_bytes(), "path": Path(name).name}


def parquet_rows(rows: list[dict], root: Path, as_list: bool) -> list[dict]:
    out = []
    for r in rows:
        row = dict(r)
        if "image" in r:
            names = r["image"] if isinstance(r["image"], list) else [r["image"]]
            structs = [image_struct(root, n) for n in names]
            row["image"] = structs if as_list else structs[0]
        out.append(row)
    return out


def write_parquet(rows: list[dict], path: Path, row_group_size: int = 3) -> Path:
    """Rows as one parquet shard (pyarrow infers the HF Image struct {bytes: binary, path: string})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # pyarrow infers from the first row only
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_tar(rows: list[dict], root: Path, path: Path, truncate_last: int = 0) -> Path:
    """Rows as one WebDataset shard: `<id>.json` then its images as `<id>.<k>.<ext>` (member order);
    `truncate_last` drops that many bytes from the end of the file (a torn download)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for r in rows:
            record = {k: v for k, v in r.items() if k != "image"}
            _add(tf, f"{r['id']}.json", json.dumps(record).encode())
            names = r.get("image", [])
            for k, name in enumerate(names if isinstance(names, list) else [names]):
                _add(tf, f"{r['id']}.{k}.{Path(name).suffix[1:]}", (root / name).read_bytes())
    if truncate_last:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate_last])
    return path


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def three_formats(out: Path, samples: int = 24, tile: int = 28) -> dict[str, tuple[str, Path]]:
    """{"jsonl" | "parquet" | "tar": (data.source, the folder relative media resolve against)}."""
    root, shards = synth_records(out / "synth", samples, tile)
    write_jsonl(shards, root / "all.jsonl")
    pq_dir = out / "hf" / "data"
    for k, rows in enumerate(shards):
        write_parquet(
            parquet_rows(rows, root, as_list=k == 1), pq_dir / f"train-0000{k}-of-00002.parquet"
        )
    for k, rows in enumerate(shards):
        write_tar(rows, root, out / "wds" / f"shard-{k:05d}.tar")
    return {
        "jsonl": (str(root / "all.jsonl"), root),
        "parquet": (str(out / "hf"), root),
        "tar": (str(out / "wds" / "shard-*.tar"), root),
    }
