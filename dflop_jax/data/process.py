"""Records -> shapes (metadata only) and -> processed samples (pixels, tokens, masks), sharing one plan.

    proc = Processor(DataConfig(model_family="llava_ov"))
    proc.shape(record)    # SampleShape: image headers, frame counts, audio windows, tokenized text
    proc.process(record)  # ProcessedSample: tiled pixels, audio features, ids, assistant mask, sources

Both go through `_plan` (the same text, the same layouts), so the counts cannot drift apart; `process`
additionally checks that the tiles it cut from real pixels are as many as the layouts promised.
Image placeholders in the token stream: LLaVA-OV one `<image>` (`<video>`) id per feature token of the
layout, InternVL `<img>` + `<IMG_CONTEXT>` per feature token + `</img>`.
LLaVA-OV samples also carry exact bilinear `feature_taps` / `feature_weight` [L, 4] (always, so packed
shapes are static): anyres_max_N downscales a big image's grid features by interpolation, which
`feature_source` (the nearest tap) only approximates.
Audio (`audio`: a path, an {bytes, path} struct, or a list of them; `<audio>` markers, added to the first
user turn when absent) is decoded to 16 kHz mono and cut into 30 s windows (`data/audio.py`); each clip
becomes `<|audio_bos|>`, one `<|AUDIO|>` per encoder output of its windows, `<|audio_eos|>` (Qwen2-Audio's
placeholders). Its length needs the decoded sample count, so `shape` decodes every clip (no features).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jinja2
import numpy as np

from dflop_jax.contracts import SampleShape
from dflop_jax.data import audio, images, video
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.chat import ROLES, ChatTemplate, to_messages
from dflop_jax.data.config import DataConfig
from dflop_jax.data.sample_arrays import FEATURE_TAPS, TEXT, ProcessedSample, plain_taps
from dflop_jax.data.tokenizer import Tokenizer, load_tokenizer
from models import layouts

KNOWN_FIELDS = frozenset(
    {"id", "image", "video", "audio", "conversations", "text", "data_source", "source"}
)
TURN_FIELDS = frozenset({"from", "value"})
MARKER = "<image>"  # an image or a video (`<video>` is read as it)
AUDIO_MARKER = "<audio>"
AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
_SPLIT = re.compile(f"({re.escape(MARKER)}|{re.escape(AUDIO_MARKER)})")


@dataclasses.dataclass(frozen=True)
class _Media:
    """One image or video of a sample: where it is, how it is tiled, which features its tokens take."""

    kind: str  # "image" (anyres / dynamic), "multi" (one tile), "video"
    path: Path | bytes  # a file, or encoded image bytes embedded in the record
    layout: layouts.FeatureLayout
    grid: tuple[int, int] = (0, 0)  # (rows, cols) of the image grid, if any
    frames: np.ndarray | None = None  # video frame indices


@dataclasses.dataclass(frozen=True)
class _Clip:
    """One audio clip: its samples (16 kHz mono) and the valid frames of each of its 30 s windows."""

    samples: np.ndarray
    windows: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Encoder outputs of the clip: its `<|AUDIO|>` tokens."""
        return sum(audio.encoder_outputs(v) for v in self.windows)


@dataclasses.dataclass(frozen=True)
class _Plan:
    sample_id: object
    location: str
    modality: str
    pieces: tuple[str, ...]  # text between placeholders (len = len(markers) + 1), or the plain text
    spans: tuple[tuple[int, int], ...]  # assistant character spans in "".join(pieces); None = all
    media: tuple[_Media, ...]
    plain: bool
    clips: tuple[_Clip, ...] = ()
    markers: tuple[str, ...] = ()  # MARKER / AUDIO_MARKER between the pieces, in order


class Processor:
    """Turns records into `SampleShape`s (cheap) and `ProcessedSample`s (pixels); both raise BadSample."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        self.tok = tokenizer or load_tokenizer(cfg.tokenizer)
        self.template = ChatTemplate.for_config(cfg.chat_template, self.tok)
        self.known_fields = KNOWN_FIELDS | set(cfg.extra_fields)
        self.known_turn_fields = TURN_FIELDS | set(cfg.extra_fields)
        tile = cfg.tile_px
        self.patches = tile // cfg.patch_size
        self.pinpoints = tuple(
            (tile * r, tile * c)
            for r in range(1, cfg.anyres_grid + 1)
            for c in range(1, cfg.anyres_grid + 1)
        )
        if cfg.model_family == "llava_ov":
            self.image_id, self.video_id = (
                self.tok.token_id("<image>"),
                self.tok.token_id("<video>"),
            )
        else:
            self.img_ids = tuple(self.tok.token_id(t) for t in ("<img>", "<IMG_CONTEXT>", "</img>"))
        self._audio_ids: tuple[int, int, int] | None = None  # looked up on the first audio clip
        eos = self.tok.hf.token_to_id(self.tok.eos_token) if self.tok.eos_token else None
        self._layouts: dict[tuple, tuple[layouts.FeatureLayout, tuple[int, int]]] = {}
        self.eos_ids = np.asarray([] if eos is None else [eos], np.int32)

    # ---- public API ---------------------------------------------------------------------------------
    def extra_keys(self, record: dict) -> tuple[str, ...]:
        """Keys the data layer does not read: a record's own, then its turns' as `conversations[].key`.

        Real LLaVA-OneVision / LLaVA-NeXT records carry source tags, metadata and sample ids beyond the
        format; they are ignored unless `data.strict` (then the record is bad: "unknown_fields").
        Internal keys (leading underscore) and `data.extra_fields` are never extra.
        """
        keys = {k for k in record if not k.startswith("_") and k not in self.known_fields}
        turns = record.get("conversations")
        if isinstance(turns, list):
            keys |= {
                f"conversations[].{k}"
                for turn in turns
                if isinstance(turn, dict)
                for k in turn
                if k not in self.known_turn_fields
            }
        return tuple(sorted(keys))

    def shape(self, record: dict) -> SampleShape:
        """Tiles and LLM tokens of the sample from metadata only (no pixel is decoded)."""
        plan = self._plan(record, with_spans=False)
        tokens = self._tokens(plan, with_mask=False)
        tiles = sum(m.layout.num_tiles for m in plan.media)
        windows = tuple(v for clip in plan.clips for v in clip.windows)
        return SampleShape(plan.sample_id, tiles, len(tokens.ids), plan.modality, windows)

    def process(self, record: dict) -> ProcessedSample:
        """Decodes and tiles the pixels (uint8), featurizes the audio, and builds ids, assistant mask
        and feature sources."""
        plan = self._plan(record, with_spans=True)
        t = self._tokens(plan, with_mask=True)
        tiles, pool = self._pixels(plan)
        expected = sum(m.layout.num_tiles for m in plan.media)
        if tiles.shape[0] != expected:  # header and pixels disagree (e.g. a lying video header)
            raise BadSample(
                "corrupt_image",
                plan.location,
                f"{tiles.shape[0]} tiles decoded, {expected} expected",
            )
        windows = tuple(
            w
            for clip in plan.clips
            for w in audio.audio_windows(clip.samples, plan.location, n_mels=self.cfg.audio_mels)
        )
        return ProcessedSample(
            plan.sample_id, t.ids, t.mask, t.source, tiles, pool, plan.modality,
            feature_taps=t.taps, feature_weight=t.weights,
            audio=windows, audio_source=t.audio if plan.clips else None,
        )  # fmt: skip

    # ---- planning (metadata) ------------------------------------------------------------------------
    def _plan(self, record: dict, with_spans: bool) -> _Plan:
        location = str(
            record["_location"] if "_location" in record else record.get("id", "<record>")
        )
        if "_error" in record:
            raise BadSample(record["_error"], location, record.get("_detail", ""))
        if self.cfg.strict and (extra := self.extra_keys(record)):
            raise BadSample(
                "unknown_fields",
                location,
                f"extra key(s) {list(extra)} under data.strict; known: {sorted(self.known_fields)}"
                " (list them in data.extra_fields, or drop data.strict to ignore them)",
            )
        sample_id = record.get("id", location)
        if "conversations" not in record and "text" in record:
            if not isinstance(record["text"], str) or not record["text"]:
                raise BadSample("no_conversations", location, "`text` must be a non-empty string")
            return _Plan(sample_id, location, "text", (record["text"],), (), (), True)
        conversations = _check_conversations(record, location)
        media, modality = self._media(record, location)
        clips = self._clips(record, location)
        if clips:
            modality = "audio" if modality == "text" else "omni"
        messages = _place_markers(conversations, len(media), len(clips), location)
        messages = to_messages(messages, self.cfg.system_prompt)
        try:
            if with_spans:
                text, spans = self.template.render_with_spans(messages)
            else:
                text, spans = self.template.render(messages), []
        except (
            jinja2.TemplateError
        ) as e:  # e.g. a template's raise_exception("roles must alternate")
            raise BadSample(
                "no_conversations", location, f"chat template refused it: {e}"
            ) from None
        parts = _SPLIT.split(text)
        pieces, markers = tuple(parts[0::2]), tuple(parts[1::2])
        for marker, n in ((MARKER, len(media)), (AUDIO_MARKER, len(clips))):
            if markers.count(marker) != n:
                raise BadSample(
                    "bad_markers",
                    location,
                    f"{markers.count(marker)} `{marker}` after templating for {n} media",
                )
        return _Plan(
            sample_id, location, modality, pieces, tuple(spans), tuple(media), False,
            tuple(clips), markers,
        )  # fmt: skip

    def _media(self, record: dict, location: str) -> tuple[list[_Media], str]:
        # `image: []` / `image: null` is how HF datasets store a text-only row in a media column.
        given = [k for k in ("image", "video") if record.get(k) not in (None, [])]
        if len(given) == 2:
            raise BadSample("unknown_fields", location, "a record has `image` or `video`, not both")
        if given == ["video"]:
            path = _resolve(record, "video", "_video_root", location)
            idx = video.video_indices(path, location, self.cfg.video_fps, self.cfg.max_frames)
            return [_Media("video", path, self._video_layout(len(idx)), frames=idx)], "video"
        if not given:
            _check_no_markers(record, ("image", "video"), (MARKER, "<video>"), location)
            return [], "text"
        refs = record["image"] if isinstance(record["image"], list) else [record["image"]]
        paths = [_media_source(record, "image", ref, location) for ref in refs]
        kind = "image" if len(paths) == 1 or self.cfg.model_family == "internvl" else "multi"
        media = [self._image_media(p, kind, location) for p in paths]
        return media, ("image" if len(paths) == 1 else "multi_image")

    def _clips(self, record: dict, location: str) -> list[_Clip]:
        """The record's audio clips, decoded (16 kHz mono) and cut into windows; [] without audio."""
        if record.get("audio") in (None, []):
            _check_no_markers(record, ("audio",), (AUDIO_MARKER,), location)
            return []
        refs = record["audio"] if isinstance(record["audio"], list) else [record["audio"]]
        clips = []
        for ref in refs:
            src = _media_source(record, "audio", ref, location)
            samples = audio.decode_audio(src, location, max_seconds=self.cfg.max_audio_s)
            clips.append(_Clip(samples, audio.window_frames(len(samples), location)))
        return clips

    def _image_media(self, path: Path | bytes, kind: str, location: str) -> _Media:
        hw = images.image_size(path, location)
        key = (kind, hw)  # datasets repeat image sizes; layouts (bilinear taps) cost milliseconds
        if key not in self._layouts:
            if len(self._layouts) >= 4096:
                self._layouts.clear()
            self._layouts[key] = self._image_layout(kind, hw)
        layout, grid = self._layouts[key]
        return _Media(kind, path, layout, grid)

    def _image_layout(
        self, kind: str, hw: tuple[int, int]
    ) -> tuple[layouts.FeatureLayout, tuple[int, int]]:
        cfg, tile = self.cfg, self.cfg.tile_px
        if cfg.model_family == "internvl":
            grid = (
                layouts.internvl_grid(hw, tile_size=tile, max_tiles=cfg.dynamic_max_tiles)
                if cfg.dynamic_max_tiles > 1
                else (1, 1)
            )
            layout = layouts.internvl_image_layout(
                hw, tile_size=tile, max_tiles=cfg.dynamic_max_tiles, use_thumbnail=cfg.use_thumbnail,
                tokens_per_tile=(self.patches // 2) ** 2,
            )  # fmt: skip
            return layout, grid
        if kind == "multi":
            return layouts.llava_ov_multi_image_layout(patches_per_side=self.patches), (1, 1)
        grid = layouts.llava_ov_grid(hw, self.pinpoints, tile)
        layout = layouts.llava_ov_image_layout(
            hw,
            pinpoints=self.pinpoints,
            tile_size=tile,
            patches_per_side=self.patches,
            max_num_patches=cfg.anyres_max,
        )
        return layout, grid

    def _video_layout(self, frames: int) -> layouts.FeatureLayout:
        if self.cfg.model_family == "llava_ov":
            return layouts.llava_ov_video_layout(frames, patches_per_side=self.patches)
        tpt = (self.patches // 2) ** 2  # InternVL: one 448 px tile per frame, 256 tokens
        return layouts.FeatureLayout(frames, tpt, np.arange(frames * tpt, dtype=np.int32))

    # ---- tokens -------------------------------------------------------------------------------------
    def _tokens(self, plan: _Plan, with_mask: bool) -> _Tokens:
        """The sample's token arrays, truncated per `too_long`; the assistant mask only `with_mask`,
        and the exact LLaVA-OV taps only then too (shape-only planning needs neither)."""
        parts = _TokenParts(with_mask, with_mask and self.cfg.model_family == "llava_ov")
        char0, tile0, output0 = 0, 0, 0
        media, clips = iter(plan.media), iter(plan.clips)
        for i, piece in enumerate(plan.pieces):
            piece_ids, offsets = self.tok.encode(piece)
            learn = None
            if with_mask:
                learn = (
                    np.ones(len(piece_ids), bool)
                    if plan.plain
                    else _in_spans(offsets[:, 0] + char0, plan.spans)
                )
            parts.text(piece_ids, learn)
            if i == len(plan.markers):
                break
            char0 += len(piece) + len(plan.markers[i])
            if plan.markers[i] == MARKER:
                m = next(media)
                ids, source = self._placeholder(m, tile0)
                # llava_ov placeholders are exactly the layout's positions
                parts.media(ids, source, m.layout.offset_taps(tile0) if parts.with_taps else None)
                tile0 += m.layout.num_tiles
            else:
                n = next(clips).tokens
                parts.audio(self._audio_placeholder(n), output0)
                output0 += n
        if plan.plain:
            parts.text(self.eos_ids, np.ones(len(self.eos_ids), bool))
        return self._fit(plan, parts.arrays())

    def _placeholder(self, m: _Media, tile0: int) -> tuple[np.ndarray, np.ndarray]:
        src = m.layout.offset(tile0)
        if self.cfg.model_family == "llava_ov":
            tid = self.video_id if m.kind == "video" else self.image_id
            return np.full(len(src), tid, np.int32), src
        start, ctx, end = self.img_ids
        if m.kind != "video":
            ids = np.concatenate([[start], np.full(len(src), ctx), [end]])
            return ids.astype(np.int32), np.concatenate([[TEXT], src, [TEXT]]).astype(np.int32)
        per = m.layout.tokens_per_tile  # each frame wrapped in <img> ... </img>
        frame = np.concatenate([[start], np.full(per, ctx), [end]])
        frame_src = [
            np.concatenate([[TEXT], src[f * per : (f + 1) * per], [TEXT]])
            for f in range(m.layout.num_tiles)
        ]
        return np.tile(frame, m.layout.num_tiles).astype(np.int32), np.concatenate(
            frame_src
        ).astype(np.int32)

    def _audio_placeholder(self, outputs: int) -> np.ndarray:
        """`<|audio_bos|>`, `outputs` x `<|AUDIO|>`, `<|audio_eos|>` (int32)."""
        if self._audio_ids is None:
            self._audio_ids = tuple(self.tok.token_id(t) for t in AUDIO_TOKENS)
        bos, token, eos = self._audio_ids
        return np.asarray([bos, *([token] * outputs), eos], np.int32)

    def _fit(self, plan: _Plan, t: _Tokens) -> _Tokens:
        limit = self.cfg.max_tokens
        if len(t.ids) <= limit:
            return t
        if self.cfg.too_long == "skip" or t.media_end > limit:
            raise BadSample("too_long", plan.location, f"{len(t.ids)} tokens > max_tokens={limit}")
        cut = t.cut(limit)  # only text after the last placeholder is cut (media_end <= limit)
        if t.mask.size and not cut.mask.any():
            raise BadSample(
                "too_long", plan.location, f"no assistant token within max_tokens={limit}"
            )
        return cut

    # ---- pixels -------------------------------------------------------------------------------------
    def _pixels(self, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
        """([n_tiles, H, W, 3] uint8, [n_tiles] bool pooled) in layout order (normalized on device)."""
        tile = self.cfg.tile_px
        chunks, pools = [np.zeros((0, tile, tile, 3), np.uint8)], [np.zeros(0, bool)]
        for m in plan.media:
            t = self._media_tiles(m, plan.location)
            chunks.append(t)
            pools.append(np.full(len(t), m.kind == "video" and self.cfg.model_family == "llava_ov"))
        tiles = np.concatenate(chunks)
        return tiles, np.concatenate(pools)

    def _media_tiles(self, m: _Media, location: str) -> np.ndarray:
        tile, cfg = self.cfg.tile_px, self.cfg
        if m.kind == "video":
            frames = video.load_frames(m.path, location, m.frames)
            return np.stack([images.squash_tile(f, tile) for f in frames])
        img = images.load_image(m.path, location)
        if m.kind == "multi":
            return images.pad_square_tile(img, tile, cfg.mean)[None]
        rows, cols = m.grid
        if cfg.model_family == "llava_ov":
            return np.concatenate(
                [
                    images.squash_tile(img, tile)[None],
                    images.anyres_grid_tiles(img, rows, cols, tile),
                ]
            )
        grid = images.resize_grid_tiles(img, rows, cols, tile)
        if rows * cols > 1 and cfg.use_thumbnail:
            grid = np.concatenate([grid, images.squash_tile(img, tile)[None]])
        return grid


def _check_conversations(record: dict, location: str) -> list[dict]:
    conv = record.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise BadSample("no_conversations", location, "missing or empty `conversations`")
    for turn in conv:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("value"), str)
            or "from" not in turn
        ):
            raise BadSample(
                "no_conversations", location, f"a turn must be {{from, value}}: {turn!r}"
            )
        if turn["from"] not in ROLES:
            raise BadSample(
                "unknown_fields", location, f"turn {turn!r}: `from` must be one of {sorted(ROLES)}"
            )
    if not any(ROLES[t["from"]] == "assistant" for t in conv):
        raise BadSample("no_conversations", location, "no assistant (gpt) turn to learn from")
    return conv


def _check_no_markers(record: dict, keys, markers, location: str) -> None:
    """A record whose media column is empty (`image: []`, `audio: null`) has none of that media: a
    marker of it in its conversations names media it does not have."""
    empty = [k for k in keys if k in record]
    count = sum(t["value"].count(m) for t in record["conversations"] for m in markers)
    if empty and count:
        raise BadSample(
            "bad_markers",
            location,
            f"`{empty[0]}` is {record[empty[0]]!r} (no media) but the conversations hold "
            f"{count} {'/'.join(f'`{m}`' for m in markers)} marker(s)",
        )


def _place_markers(
    conversations: list[dict], n_media: int, n_clips: int, location: str
) -> list[dict]:
    """Normalizes `<video>` to `<image>`; adds missing markers to the first user turn (LLaVA does)."""
    conv = [
        {"from": t["from"], "value": t["value"].replace("<video>", MARKER)} for t in conversations
    ]
    for marker, n in ((MARKER, n_media), (AUDIO_MARKER, n_clips)):
        if any(ROLES[t["from"]] != "user" and marker in t["value"] for t in conv):
            raise BadSample("bad_markers", location, f"`{marker}` marker outside a user turn")
        count = sum(t["value"].count(marker) for t in conv)
        if count == 0 and n:
            first = next(i for i, t in enumerate(conv) if ROLES[t["from"]] == "user")
            conv[first] = {**conv[first], "value": (marker + "\n") * n + conv[first]["value"]}
        elif count != n:
            what = "images/videos" if marker == MARKER else "audio clips"
            raise BadSample("bad_markers", location, f"{count} `{marker}` markers for {n} {what}")
    return conv


def _resolve(record: dict, key: str, root_key: str, location: str) -> Path:
    value = record[key]
    if not isinstance(value, str) or not value:
        raise BadSample("missing_file", location, f"`{key}` must be a path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_absolute() and root_key in record:
        path = Path(record[root_key]) / path
    return path


def _media_source(record: dict, kind: str, ref, location: str) -> Path | bytes:
    """One entry of `image` or `audio`: a path, or HF's Image / Audio struct {bytes, path} (the bytes
    when present, else the path), as parquet and tar shards carry media."""
    if isinstance(ref, dict) and set(ref) <= {"bytes", "path"}:
        if isinstance(ref.get("bytes"), bytes) and ref["bytes"]:
            return ref["bytes"]
        ref = ref.get("path")
    if not isinstance(ref, str) or not ref:
        raise BadSample(
            "missing_file",
            location,
            f"`{kind}` must be a path, an {{bytes, path}} struct, or a list of them: {ref!r:.80}",
        )
    return _resolve({**record, kind: ref}, kind, f"_{kind}_root", location)


def _in_spans(starts: np.ndarray, spans) -> np.ndarray:
    out = np.zeros(len(starts), bool)
    for a, b in spans:
        out |= (starts >= a) & (starts < b)
    return out


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """A sample's token arrays: ids, assistant mask (empty when not asked for), image feature
    sources and taps (None unless exact LLaVA-OV taps were asked for), audio output sources, and
    where its last placeholder ends (truncation never cuts into one)."""

    ids: np.ndarray
    mask: np.ndarray
    source: np.ndarray
    taps: np.ndarray | None
    weights: np.ndarray | None
    audio: np.ndarray
    media_end: int

    def cut(self, n: int) -> _Tokens:
        """The first `n` positions."""
        taps = None if self.taps is None else self.taps[:n]
        weights = None if self.weights is None else self.weights[:n]
        return _Tokens(
            self.ids[:n], self.mask[:n], self.source[:n], taps, weights, self.audio[:n],
            min(self.media_end, n),
        )  # fmt: skip


class _TokenParts:
    """Builds `_Tokens` piece by piece: text, image/video placeholders, audio placeholders."""

    def __init__(self, with_mask: bool, with_taps: bool):
        self.with_mask, self.with_taps = with_mask, with_taps
        self.ids, self.mask, self.source, self.taps, self.audio_source = [], [], [], [], []
        self.length = self.media_end = 0

    def _add(self, ids, learn, source, taps, audio_source) -> None:
        self.ids.append(np.asarray(ids, np.int32))
        self.source.append(np.asarray(source, np.int32))
        self.audio_source.append(audio_source)
        if self.with_mask:
            self.mask.append(learn)
        if self.with_taps:
            self.taps.append(taps if taps is not None else plain_taps(source, FEATURE_TAPS))
        self.length += len(ids)

    def text(self, ids: np.ndarray, learn: np.ndarray | None) -> None:
        text = np.full(len(ids), TEXT, np.int32)
        self._add(ids, learn, text, None, text)

    def media(self, ids: np.ndarray, source: np.ndarray, taps) -> None:
        """An image or video placeholder, its positions taking the features `source` (and `taps`)."""
        self._add(ids, np.zeros(len(ids), bool), source, taps, np.full(len(ids), TEXT, np.int32))
        self.media_end = self.length

    def audio(self, ids: np.ndarray, first_output: int) -> None:
        """An audio placeholder (bos, outputs, eos): its outputs take the sample's audio encoder
        outputs `first_output`, `first_output + 1`, ... in order."""
        text = np.full(len(ids), TEXT, np.int32)
        outputs = text.copy()
        outputs[1:-1] = first_output + np.arange(len(ids) - 2)
        self._add(ids, np.zeros(len(ids), bool), text, None, outputs)
        self.media_end = self.length

    def arrays(self) -> _Tokens:
        taps = weights = None
        if self.with_taps:
            taps = np.concatenate([t for t, _ in self.taps]).astype(np.int32)
            weights = np.concatenate([w for _, w in self.taps]).astype(np.float32)
        return _Tokens(
            np.concatenate(self.ids),
            np.concatenate(self.mask) if self.with_mask else np.zeros(0, bool),
            np.concatenate(self.source),
            taps,
            weights,
            np.concatenate(self.audio_source),
            self.media_end,
        )
