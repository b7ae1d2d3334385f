"""Synthetic datasets on disk: LLaVA-format JSONL + real image files, frame folders, short videos, audio
clips, text.

    python -m dflop_jax.data.synth out=runs/synth samples=500 mix=llava-ov seed=0

Mixes (DESIGN section 10): `llava-ov` (single image anyres, multi-image, video, text), `dflop` (the paper's:
single image, multi-image, video), `single-image`, `multi-image`, `video`, `text`, and `internvl` (the four
InternVL SFT subsets of `data/workload_stats/omnibal_internvl`: per subset the real tile histogram and
text-length quantiles), `audio` (speech-length clips for transcription and question answering, and
longer sound clips that span several 30 s encoder windows) and `omni` (LLaVA-OV's mix with audio, and
samples holding an image and a clip). Profiled with `configs/data_internvl_stats.yaml` (InternVL family, max_tiles 4,
empty system prompt) its tiles and token means reproduce those statistics.
Images are solid colours and clips are tones (8 kHz 16-bit WAV, resampled to 16 kHz when read): only
their SIZE in pixels and LENGTH in seconds matter for tiling and windows.
Output: one JSONL per subset, `images/`, `videos/`, `audio/`, and `mix.yaml` (the path `synth_dataset`
returns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from dflop_jax.config import ConfigError, require, require_seed
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.data.mix import allot

VERSION = 1
LOCK_TIMEOUT_S = 600.0  # how long a process waits for another one writing the same dataset
# Real InternVL SFT subsets (OmniBal stats): sample count, histogram of tiles 1..5, text-token quantiles
# (token_num - 256 * tiles) at 0, 5, ..., 100 %.
INTERNVL_SUBSETS = {
    "ai2d": (12413, (5793, 0, 3710, 603, 2307),
             (37, 41, 43, 44, 45, 47, 48, 49, 50, 51, 52, 53, 54, 55, 57, 58, 60, 63, 67, 75, 347)),
    "chartqa": (18317, (579, 0, 1096, 14, 16628),
                (33, 39, 40, 41, 42, 43, 44, 45, 47, 49, 66, 77, 81, 85, 92, 119, 139, 153, 170, 218, 552)),
    "docvqa": (10211, (15, 0, 1895, 35, 8266),
               (53, 66, 73, 82, 123, 135, 146, 167, 193, 210, 231, 257, 282, 307, 339, 378, 429, 491, 577, 697, 1258)),
    "synthdog_en": (29765, (0, 0, 17276, 0, 12489),
                    (36, 61, 68, 74, 79, 84, 89, 94, 99, 105, 110, 116, 122, 129, 137, 146, 156, 169, 187, 216, 503)),
}  # fmt: skip
# Tokens an InternVL single-image, single-turn sample has besides its text and IMG_CONTEXT tokens, with
# the bundled tokenizer, the Qwen2.5 template and an empty system prompt (checked by a test).
INTERNVL_OVERHEAD = 34
_WORDS_TEXT = (
    "the a chart shows value year red blue left right top bottom of in and with image figure text label "
    "number total increase decrease between document page table column row answer question what which how "
    "many is are was there this that scene person car tree building sky water animal small large color"
)
WORDS = tuple(_WORDS_TEXT.split(" "))
MIXES = {  # mix -> [(subset, weight)]
    "llava-ov": [("single_image", 0.45), ("multi_image", 0.15), ("video", 0.15), ("text", 0.25)],
    "dflop": [("single_image", 0.6), ("multi_image", 0.2), ("video", 0.2)],
    "single-image": [("single_image", 1.0)],
    "multi-image": [("multi_image", 1.0)],
    "video": [("video", 1.0)],
    "text": [("text", 1.0)],
    "internvl": [(name, float(v[0])) for name, v in INTERNVL_SUBSETS.items()],
    "audio": [("speech", 0.7), ("sound", 0.3)],
    "omni": [
        ("single_image", 0.3), ("multi_image", 0.1), ("video", 0.15), ("speech", 0.15),
        ("sound", 0.05), ("audio_image", 0.05), ("text", 0.2),
    ],
}  # fmt: skip
AUDIO_RATE = 8000  # Hz of the written clips


class _Writer:
    """Writes media files under `out` and makes text; every choice comes from one seeded generator."""

    def __init__(self, out: Path, rng: np.random.Generator, scale: float):
        self.out, self.rng, self.scale, self.n = out, rng, scale, 0
        (out / "images").mkdir(parents=True, exist_ok=True)
        (out / "videos").mkdir(parents=True, exist_ok=True)

    def image(self, h: int, w: int) -> str:
        """A solid-colour image of h x w (times the tile scale) pixels; returns its path relative to `out`."""
        h, w = max(8, round(h * self.scale)), max(8, round(w * self.scale))
        self.n += 1
        colour = [int(c) for c in self.rng.integers(0, 256, 3)]
        if self.n % 4:  # palette PNG: fast to write, a few KB whatever the size
            name = f"images/{self.n:06d}.png"
            img = Image.new("P", (w, h), 0)
            img.putpalette(colour)
            img.save(self.out / name, compress_level=1)
        else:
            name = f"images/{self.n:06d}.jpg"
            Image.new("RGB", (w, h), tuple(colour)).save(self.out / name, quality=75)
        return name

    def frames(self, count: int) -> str:
        """A folder of `count` small frames (already at 1 fps)."""
        self.n += 1
        name = f"videos/{self.n:06d}"
        (self.out / name).mkdir()
        for i in range(count):
            Image.new("RGB", (64, 48), (i * 8 % 256, 64, 128)).save(
                self.out / name / f"{i:05d}.jpg"
            )
        return name

    def mp4(self, seconds: int, fps: int = 4) -> str:
        """A short H.264 clip of `seconds` at `fps` (PyAV)."""
        import av

        self.n += 1
        name = f"videos/{self.n:06d}.mp4"
        with av.open(str(self.out / name), "w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(seconds * fps):
                frame = np.full((48, 64, 3), (i * 5) % 256, np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        return name

    def clip(self, seconds: float) -> str:
        """A tone of `seconds` (8 kHz mono 16-bit WAV); returns its path relative to `out`."""
        self.n += 1
        name = f"audio/{self.n:06d}.wav"
        (self.out / "audio").mkdir(exist_ok=True)
        t = np.arange(round(seconds * AUDIO_RATE)) / AUDIO_RATE
        hz = float(self.rng.uniform(150, 900))
        tone = (0.3 * 32767 * np.sin(2 * np.pi * hz * t)).astype("<i2")
        with wave.open(str(self.out / name), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(AUDIO_RATE)
            f.writeframes(tone.tobytes())
        return name

    def text(self, n_bytes: int, end: str = ".") -> str:
        """Plausible-looking ASCII text of exactly `n_bytes` bytes (one token each with the byte tokenizer)."""
        words, size = [], 0
        while size < n_bytes:
            w = WORDS[int(self.rng.integers(len(WORDS)))]
            words.append(w)
            size += len(w) + 1
        s = " ".join(words)[: max(0, n_bytes - len(end))] + end
        s = s[:n_bytes]
        return s[0].upper() + s[1:] if s else s


def _turns(w: _Writer, question: str, answer: str, prefix: str = "<image>\n") -> list[dict]:
    return [{"from": "human", "value": prefix + question}, {"from": "gpt", "value": answer}]


def _single_image(w: _Writer) -> dict:
    rng = w.rng
    h, w_px = (int(384 * x) for x in rng.uniform(0.4, 6.2, 2))  # grids 1x1 .. 6x6 of 384 px tiles
    conv = _turns(w, w.text(int(rng.integers(15, 80)), "?"), w.text(int(rng.integers(10, 400))))
    for _ in range(int(rng.integers(0, 3))):  # some multi-turn follow-ups
        conv += _turns(
            w, w.text(int(rng.integers(10, 60)), "?"), w.text(int(rng.integers(5, 150))), ""
        )
    return {"image": w.image(h, w_px), "conversations": conv}


def _multi_image(w: _Writer) -> dict:
    rng = w.rng
    n = int(min(16, 2 + rng.geometric(0.3) - 1))  # 2..16 images, mostly few
    paths = [w.image(*(int(x) for x in rng.uniform(200, 900, 2))) for _ in range(n)]
    prefix = "".join(f"Image {i + 1}: <image>\n" for i in range(n))
    conv = _turns(
        w, w.text(int(rng.integers(20, 100)), "?"), w.text(int(rng.integers(20, 300))), prefix
    )
    return {"image": paths, "conversations": conv}


def _video(w: _Writer) -> dict:
    rng = w.rng
    seconds = int(rng.integers(2, 31))  # LLaVA-Video-178K 0-30 s, sampled at 1 fps
    path = w.mp4(seconds) if rng.random() < 0.2 and _has_av() else w.frames(seconds)
    conv = _turns(
        w, w.text(int(rng.integers(15, 80)), "?"), w.text(int(rng.integers(30, 500))), "<video>\n"
    )
    return {"video": path, "conversations": conv}


def _speech(w: _Writer) -> dict:
    """A speech clip (LibriSpeech-like lengths: 1-35 s, about 12 s on average) to transcribe or ask
    about; the answer's length follows the clip's (about 15 characters a second when transcribed)."""
    rng = w.rng
    seconds = float(np.clip(rng.lognormal(2.3, 0.55), 1.0, 35.0))
    if rng.random() < 0.6:
        question, answer = "Transcribe the audio.", w.text(int(15 * seconds) + 5)
    else:
        question, answer = (
            w.text(int(rng.integers(15, 80)), "?"),
            w.text(int(rng.integers(10, 200))),
        )
    return {"audio": w.clip(seconds), "conversations": _turns(w, question, answer, "<audio>\n")}


def _sound(w: _Writer) -> dict:
    """A longer sound or music clip (20-65 s: two or three 30 s encoder windows) to describe."""
    rng = w.rng
    seconds = float(rng.uniform(20, 65))
    conv = _turns(
        w, w.text(int(rng.integers(15, 60)), "?"), w.text(int(rng.integers(40, 300))), "<audio>\n"
    )
    return {"audio": w.clip(seconds), "conversations": conv}


def _audio_image(w: _Writer) -> dict:
    """An image and a spoken question about it."""
    rng = w.rng
    h, w_px = (int(384 * x) for x in rng.uniform(0.4, 3.0, 2))
    seconds = float(np.clip(rng.lognormal(1.6, 0.4), 1.0, 15.0))
    conv = _turns(w, "Answer the spoken question.", w.text(int(rng.integers(10, 200))),
                  "<image>\n<audio>\n")  # fmt: skip
    return {"image": w.image(h, w_px), "audio": w.clip(seconds), "conversations": conv}


def _text(w: _Writer) -> dict:
    rng = w.rng
    kind = rng.random()
    if kind < 0.5:  # short QA: tens of tokens
        return {
            "conversations": _turns(
                w, w.text(int(rng.integers(10, 60)), "?"), w.text(int(rng.integers(5, 60))), ""
            )
        }
    if kind < 0.8:  # long caption: hundreds
        return {
            "conversations": _turns(
                w, w.text(int(rng.integers(20, 60)), "?"), w.text(int(rng.integers(200, 900))), ""
            )
        }
    conv = []
    for _ in range(int(rng.integers(2, 6))):  # multi-turn chat
        conv += _turns(
            w, w.text(int(rng.integers(10, 80)), "?"), w.text(int(rng.integers(10, 200))), ""
        )
    return {"conversations": conv}


def _internvl(name: str, count: int, rng: np.random.Generator):
    """A generator of `count` records of one subset, stratified so that small datasets keep the real
    means: tiles allotted by the histogram (largest remainders), text lengths at stratified quantiles."""
    _, hist, quantiles = INTERNVL_SUBSETS[name]
    tiles = np.repeat(np.arange(1, 6), allot(count, hist))
    u = (np.arange(count) + rng.random(count)) / max(count, 1)
    texts = np.round(np.interp(u, np.linspace(0, 1, len(quantiles)), quantiles)).astype(int)
    plan = list(zip(rng.permutation(tiles), rng.permutation(texts)))

    def make(w: _Writer) -> dict:
        n_tiles, text = plan.pop()
        h, w_px = _internvl_size(w.rng, int(n_tiles))
        budget = max(6, int(text) - INTERNVL_OVERHEAD)
        q = max(3, int(budget * w.rng.uniform(0.3, 0.6)))
        conv = _turns(w, w.text(q, "?"), w.text(max(2, budget - q)))
        return {"image": w.image(h, w_px), "conversations": conv}

    return make


def _internvl_size(rng: np.random.Generator, tiles: int) -> tuple[int, int]:
    """An (h, w) whose InternVL dynamic tiling (448 px, max_tiles >= 4) gives `tiles` tiles incl. thumbnail.

    Exact integer aspect ratios k:1 with a short side <= 630 px keep the k x 1 grid for any max_tiles
    (a finer grid of the same ratio needs more area), and a square of 640..940 px gives 2x2.
    """
    if tiles == 1:
        s = int(rng.integers(200, 449))
        return s, s
    if tiles == 5 and rng.random() < 0.7:
        s = int(rng.integers(640, 941))
        return s, s
    k = {3: 2, 4: 3, 5: 4}[tiles]
    short = int(rng.integers(250, 631))
    return (short, short * k) if rng.random() < 0.7 else (short * k, short)


GENERATORS = {
    "single_image": _single_image,
    "multi_image": _multi_image,
    "video": _video,
    "text": _text,
    "speech": _speech,
    "sound": _sound,
    "audio_image": _audio_image,
}


def _has_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def synth_dataset(
    out_dir, num_samples: int, mix: str = "llava-ov", seed: int = 0, tile: int | None = None
) -> Path:
    """Writes (or reuses, if already written with the same arguments) a dataset; returns its mix.yaml.

    Args:
      out_dir: target folder (created; refused if it holds files that are not a synthetic dataset).
      num_samples: total records over all subsets.
      mix: one of `MIXES`.
      seed: every size, length and colour derives from it.
      tile: the encoder tile size the image sizes are scaled to (default 384, 448 for "internvl").
    """
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: choose one of {sorted(MIXES)}")
    out = Path(out_dir)
    base = 448 if mix == "internvl" else 384
    params = {
        "version": VERSION,
        "samples": int(num_samples),
        "mix": mix,
        "seed": int(seed),
        "tile": tile or base,
    }
    marker = out / "synth.json"
    if _written_with(marker, params):
        return out / "mix.yaml"
    if out.exists() and any(out.iterdir()) and not marker.is_file():
        raise ValueError(
            f"synth: {out} is not empty and not a synthetic dataset; choose another --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes of one run (or hosts on a shared filesystem) may ask for the same dataset at
    # once: one writes while the others wait on the lock, then they all reuse its output.
    with _exclusive(out.parent / f".{out.name}.lock"):
        if not _written_with(marker, params):
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                _write(staging, num_samples, mix, seed, (tile or base) / base)
                (staging / "synth.json").write_text(json.dumps(params))
                # An older synthetic dataset (its marker differs) is replaced, not merged into.
                shutil.rmtree(out, ignore_errors=True)
                # Publish whole: a run killed half-way leaves only a hidden staging folder behind.
                os.rename(staging, out)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return out / "mix.yaml"


def _written_with(marker: Path, params: dict) -> bool:
    try:
        return json.loads(marker.read_text()) == params
    except (OSError, json.JSONDecodeError):
        return False


def _write(out: Path, num_samples: int, mix: str, seed: int, scale: float) -> None:
    """Writes every subset's JSONL, its media and mix.yaml under `out`."""
    rng = np.random.default_rng(seed)
    writer = _Writer(out, rng, scale)
    subsets, weights = zip(*MIXES[mix])
    datasets = []
    for name, count in zip(subsets, allot(num_samples, weights)):
        make = _internvl(name, count, rng) if mix == "internvl" else GENERATORS[name]
        with (out / f"{name}.jsonl").open("w") as f:
            for i in range(count):
                f.write(
                    json.dumps({"id": f"{name}-{i}", "data_source": name, **make(writer)}) + "\n"
                )
        datasets.append({"path": f"{name}.jsonl", "sampling": "all"})
    (out / "mix.yaml").write_text(yaml.safe_dump({"datasets": datasets}, sort_keys=False))


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float = LOCK_TIMEOUT_S):
    """An advisory file lock, waited for at most `timeout_s` (another process is writing the data)."""
    with lock_path.open("a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"synth: waited {timeout_s:.0f} s for {lock_path} (another process writing "
                        "the dataset?); delete the lock file if no such process is running"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclasses.dataclass(frozen=True)
class SynthConfig:
    """A synthetic dataset to write.

    Attributes:
      out: the output folder (created; a folder holding anything else is refused).
      samples: records to write.
      mix: the modality mix (see `MIXES`).
      seed: seed of the records and images.
      tile_size: tile size the image sizes scale to (0 = the mix's default).
    """

    out: str = ""
    samples: int = 500
    mix: str = "llava-ov"
    seed: int = 0
    tile_size: int = 0

    def __post_init__(self):
        require(bool(self.out), "out", self.out, "give the output folder, e.g. out=runs/synth")
        require(self.samples >= 1, "samples", self.samples, "must be >= 1")
        require(self.mix in MIXES, "mix", self.mix, f"use one of {sorted(MIXES)}")
        require(self.tile_size >= 0, "tile_size", self.tile_size, "0 (default) or pixels")
        require_seed(self.seed, "seed")


COMMAND = Command(
    prog="python -m dflop_jax.data.synth",
    description=__doc__.split("\n")[0],
    example="python -m dflop_jax.data.synth out=runs/example_data samples=16 mix=llava-ov",
)


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    try:
        cfg = load_command_config(SynthConfig, args)
        path = synth_dataset(cfg.out, cfg.samples, cfg.mix, cfg.seed, cfg.tile_size or None)
    except ConfigError as e:
        return config_error(e)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.samples} samples ({cfg.mix}) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
