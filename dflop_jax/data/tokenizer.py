"""Tokenizers: HF `tokenizers` from a model directory, or the bundled byte-level one (no hub needed).

    tok = load_tokenizer("bundled")                 # 256 byte tokens + chat/image special tokens
    tok = load_tokenizer("/models/Qwen2.5-7B")      # tokenizer.json + tokenizer_config.json
    ids, offsets = tok.encode("<|im_start|>user\\nhi<|im_end|>\\n")

Rebuild the bundled asset: `python -m dflop_jax.data.tokenizer` (writes assets/byte_tokenizer.json).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dflop_jax.config import ConfigError

ASSET = Path(__file__).parent / "assets" / "byte_tokenizer.json"

# Special tokens of the bundled tokenizer, ids 256.. in this order. Chat formats of Qwen2.5 (ChatML) and
# Llama 3, LLaVA-OV's image/video placeholders, InternVL's image tokens, Qwen2-Audio's audio tokens.
BUNDLED_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
    "<video>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
)


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE without merges: every UTF-8 byte is one token (ids 0..255), then the specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _byte_chars())}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BUNDLED_SPECIALS))
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (the alphabet ByteLevel uses), in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer plus what the chat template and image placeholders need.

    Attributes:
      hf: the `tokenizers.Tokenizer`.
      name: "bundled" or the model directory.
      chat_template: the tokenizer's own jinja chat template (None when it has none).
      bos_token, eos_token: strings the chat templates may reference ("" when undefined).
    """

    hf: tokenizers.Tokenizer
    name: str
    chat_template: str | None
    bos_token: str
    eos_token: str

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """([n] int32 ids, [n, 2] int64 character offsets) of `text`, no special tokens added."""
        enc = self.hf.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, np.int32), offsets

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """The id of a single (special) token; a clear error when the tokenizer lacks it."""
        tid = self.hf.token_to_id(token)
        if tid is None:
            raise ConfigError(
                f"tokenizer {self.name}: has no token {token!r}; add it as a special token"
            )
        return tid


def load_tokenizer(spec: str) -> Tokenizer:
    """`spec` is "bundled" or a directory holding tokenizer.json (+ tokenizer_config.json)."""
    if spec == "bundled":
        hf = (
            tokenizers.Tokenizer.from_file(str(ASSET))
            if ASSET.is_file()
            else build_byte_tokenizer()
        )
        return Tokenizer(hf, "bundled", None, "<|begin_of_text|>", "<|endoftext|>")
    root = Path(spec).expanduser()
    if not (root / "tokenizer.json").is_file():
        raise ConfigError(
            f"data.tokenizer={spec!r}: no tokenizer.json there; give an HF model dir or 'bundled'"
        )
    hf = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    config = _read_json(root / "tokenizer_config.json")
    template = _chat_template(root, config)
    return Tokenizer(
        hf,
        str(root),
        template,
        _token_str(config.get("bos_token")),
        _token_str(config.get("eos_token")),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _chat_template(root: Path, config: dict) -> str | None:
    """HF keeps it in chat_template.jinja (transformers 5) or tokenizer_config.json's `chat_template`."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _token_str(value) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


if __name__ == "__main__":
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(ASSET))
    print(f"wrote {ASSET} ({build_byte_tokenizer().get_vocab_size()} tokens)")
