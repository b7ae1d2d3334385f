"""Parity with HF transformers: chat templates (Qwen2.5, Llama 3) and LLaVA-OneVision token/tile counts."""

import json
from unittest import mock

import numpy as np
import pytest
from PIL import Image

from dflop_jax.data.chat import LLAMA3_TEMPLATE, QWEN25_TEMPLATE, ChatTemplate
from dflop_jax.data.config import DataConfig
from dflop_jax.data.process import Processor
from dflop_jax.data.tokenizer import ASSET, load_tokenizer
from models.vit import normalize_pixels

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nWhat is in the picture?  "},
        {"role": "assistant", "content": " A cat on a mat. "},
        {"role": "user", "content": "Colour?"},
        {"role": "assistant", "content": "Grey — mostly."},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ASSET), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, LLAMA3_TEMPLATE], ids=["qwen2.5", "llama3"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_matches_transformers(hf_tokenizer, template, chat, gen):
    ours = ChatTemplate(template, "<|begin_of_text|>", "<|endoftext|>").render(
        CHATS[chat], add_generation_prompt=gen
    )
    theirs = hf_tokenizer.apply_chat_template(
        CHATS[chat], chat_template=template, tokenize=False, add_generation_prompt=gen
    )
    assert ours == theirs
    ids, _ = load_tokenizer("bundled").encode(ours)
    assert ids.tolist() == hf_tokenizer(ours, add_special_tokens=False)["input_ids"]


def test_template_from_tokenizer_dir(hf_tokenizer, tmp_path):
    hf_tokenizer.chat_template = LLAMA3_TEMPLATE
    hf_tokenizer.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.bos_token == "<|begin_of_text|>" and tok.vocab_size == len(hf_tokenizer)
    ours = ChatTemplate.for_config("from_tokenizer", tok).render(CHATS[1])
    assert ours == hf_tokenizer.apply_chat_template(CHATS[1], tokenize=False)


def _hf_processor(hf_tokenizer):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    ip = LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    # No video processor (it needs torchvision): skip the class check that insists on one.
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None):
        return transformers.LlavaOnevisionProcessor(
            image_processor=ip, tokenizer=hf_tokenizer, video_processor=None,
            num_image_tokens=729, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
        )  # fmt: skip


SIZES = [(600, 1000), (1700, 300), (384, 384), (2000, 2300), (100, 1500), (900, 880), (1152, 768)]


def _normalized(tiles: np.ndarray, cfg: DataConfig) -> np.ndarray:
    """Our uint8 tiles as the model's first stage sees them (mean/std of the data config)."""
    assert tiles.dtype == np.uint8
    return np.asarray(normalize_pixels(tiles, cfg.mean, cfg.std))


def test_llava_ov_tokens_and_tiles_match_hf_processor(hf_tokenizer, tmp_path):
    proc_hf = _hf_processor(hf_tokenizer)
    records = []
    for i, (h, w) in enumerate(SIZES):
        pixels = np.zeros((h, w, 3), np.uint8)  # gradients: a misplaced or mis-resized tile shows
        pixels[..., 0] = np.linspace(0, 255, w)[None, :]
        pixels[..., 1] = np.linspace(0, 255, h)[:, None]
        pixels[..., 2] = i * 30
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        conv = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Ok."}]
        records.append({"id": i, "image": f"{i}.png", "conversations": conv})
    multi = [
        {"from": "human", "value": "<image><image><image>\nDescribe."},
        {"from": "gpt", "value": "Ok."},
    ]
    records.append({"id": "m", "image": ["0.png", "1.png", "2.png"], "conversations": multi})
    (tmp_path / "d.json").write_text(json.dumps(records))
    cfg = DataConfig(source=str(tmp_path / "d.json"))
    ours = Processor(cfg)
    from dflop_jax.data.dataset import load_source

    for rec in load_source(cfg):
        names = rec["image"] if isinstance(rec["image"], list) else [rec["image"]]
        imgs = [Image.open(tmp_path / n).convert("RGB") for n in names]
        text = ours.template.render(
            [{"role": "user", "content": "<image>" * len(imgs) + "\nDescribe."}]
        )
        out = proc_hf(images=[imgs], text=[text], return_tensors="np")
        hf_image_tokens = int((out["input_ids"] == proc_hf.image_token_id).sum())
        hf_tiles = int(out["pixel_values"].shape[0] * out["pixel_values"].shape[1])
        sample = ours.process(rec)
        assert int((sample.token_ids == ours.tok.token_id("<image>")).sum()) == hf_image_tokens, (
            rec["id"]
        )
        assert sample.num_tiles == hf_tiles == ours.shape(rec).tiles, rec["id"]
        # Same pixels, tile by tile (HF pads the patch axis of a batch; multi-image keeps one tile each).
        hf_pixels = out["pixel_values"][:, : 1 if len(imgs) > 1 else None]
        hf_pixels = np.transpose(hf_pixels, (0, 1, 3, 4, 2)).reshape(sample.tiles.shape)
        diffs = np.abs(_normalized(sample.tiles, cfg) - hf_pixels).mean((1, 2, 3))
        assert diffs.max() < 0.01, (rec["id"], diffs)  # resampling rounding only


@pytest.mark.parametrize("max_tiles", [4, 12])
def test_internvl_tiles_match_hf_image_processor(tmp_path, max_tiles):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    cfg = DataConfig(source="x", model_family="internvl", max_tiles=max_tiles)
    hf = GotOcr2ImageProcessorPil(
        crop_to_patches=True, min_patches=1, max_patches=max_tiles, size={"height": 448, "width": 448},
        image_mean=list(cfg.mean), image_std=list(cfg.std),
    )  # fmt: skip
    ours = Processor(cfg)
    for i, (h, w) in enumerate([(600, 1000), (1700, 300), (900, 880), (300, 300), (448, 1344)]):
        pixels = np.zeros((h, w, 3), np.uint8)
        pixels[..., 0] = np.linspace(0, 255, w)[None, :]
        pixels[..., 1] = np.linspace(0, 255, h)[:, None]
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        conv = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "Ok."}]
        rec = {
            "id": i,
            "image": f"{i}.png",
            "conversations": conv,
            "_location": "t",
            "_image_root": str(tmp_path),
        }
        theirs = np.transpose(
            hf(images=[Image.open(tmp_path / f"{i}.png")], return_tensors="np")["pixel_values"],
            (0, 2, 3, 1),
        )
        sample = ours.process(rec)
        assert sample.num_tiles == len(theirs) == ours.shape(rec).tiles, (h, w)
        np.testing.assert_allclose(_normalized(sample.tiles, cfg), theirs, atol=1e-5)
        assert int((sample.token_ids == ours.tok.token_id("<IMG_CONTEXT>")).sum()) == 256 * len(
            theirs
        )
