"""Bad input: one exception type with a machine-readable reason, so the loader can count skips by reason.

try:
    shape = processor.shape(record)
except BadSample as e:
    counts[e.reason] += 1   # logged once with e.location, skipped (or re-raised in strict mode)
"""

from __future__ import annotations

REASONS = (
    "missing_file",  # an image/video/audio file or frame folder named by the record does not exist
    "corrupt_image",  # Pillow cannot read the header or the pixels (truncated, not an image)
    "unreadable_video",  # PyAV cannot open/decode it, or a frame folder is empty
    "invalid_json",  # a JSONL line (or a whole JSON file) does not parse, or a record is not an object
    "no_conversations",  # no `conversations`/`text`, empty, or no assistant turn to learn from
    "unknown_fields",  # a turn's `from` is no known role, image + video together, extra keys (strict)
    "too_long",  # more LLM tokens than `max_tokens` (policy "skip") or unfit for truncation
    "bad_markers",  # `<image>`/`<audio>` markers not matching the media (none: `image` empty), or in a non-user turn
    "corrupt_shard",  # a parquet row group or tar member that cannot be read (truncated, damaged)
    "unreadable_audio",  # PyAV cannot open/decode it, or it holds no audio stream
    "empty_audio",  # decodes to no samples, or too few for one encoder output
    "audio_too_long",  # longer than the `max_seconds` the caller allows (`data.max_audio_s`)
    "no_audio_encoder",  # a sample with audio, for a model without an audio encoder
    "no_vision_encoder",  # a sample with images or video, for a model without a vision encoder
)


class BadSample(Exception):
    """A record that cannot become a training sample.

    Attributes:
      reason: one of `REASONS`.
      location: where the record came from (`file:line`, `file[index]`, `shard:row`, `shard.tar:key`,
        or the record's id).
      detail: a short human explanation.
    """

    def __init__(self, reason: str, location: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"BadSample reason {reason!r} is not one of {REASONS}")
        self.reason = reason
        self.location = location
        self.detail = detail
        super().__init__(f"{location}: {reason}" + (f": {detail}" if detail else ""))

    def __reduce__(self):  # picklable across grain worker processes
        return (BadSample, (self.reason, self.location, self.detail))
