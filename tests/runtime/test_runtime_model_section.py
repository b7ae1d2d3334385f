"""The training config's model section: keys that reach the `models` config."""

import pytest

from dflop_jax.config import ConfigError, from_dict
from dflop_jax.programs.model_section import ModelConfig
from dflop_jax.runtime.config import TrainConfig


@pytest.mark.parametrize("kind", ["llava_ov", "internvl", "decoder"])
def test_attention_impl_reaches_every_attention_layer(kind):
    cfg = ModelConfig(kind=kind, attention_impl="cudnn")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    text = model_cfg if kind == "decoder" else model_cfg.text
    assert text.attention_impl == "cudnn"
    if kind != "decoder":
        assert model_cfg.vision.attention_impl == "cudnn"


@pytest.mark.parametrize("source", ["built", "arch"])
def test_vision_attention_impl_sets_the_vision_tower_alone(source):
    """The vision tower's kernel where it differs from the decoder's."""
    keys = {"arch": "siglip-so400m+qwen2.5-7b"} if source == "arch" else {}
    cfg = ModelConfig(**keys, attention_impl="cudnn", vision_attention_impl="pallas")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    assert (model_cfg.text.attention_impl, model_cfg.vision.attention_impl) == ("cudnn", "pallas")


# (platform, compute capability, jax) -> (vision, llm): CPU; H100 / H200 and Blackwell on a verified
# jax; Hopper on a jax outside the verified range (old and new); A100; a GPU reporting no capability.
AUTO_CASES = [
    (("cpu", None, "0.10.2"), ("xla", "xla")),
    (("gpu", "9.0", "0.10.2"), ("cudnn", "cudnn")),
    (("gpu", "9.0", "0.11.1.dev20260808"), ("cudnn", "cudnn")),
    (("gpu", "10.0", "0.11.0"), ("cudnn", "cudnn")),
    (("gpu", "9.0", "0.9.2"), ("cudnn", "pallas")),
    (("gpu", "9.0", "0.12.0"), ("cudnn", "pallas")),
    (("gpu", "8.0", "0.10.2"), ("pallas", "pallas")),
    (("gpu", None, "0.10.2"), ("pallas", "pallas")),
]


@pytest.mark.parametrize("facts, want", AUTO_CASES)
def test_auto_resolves_per_device_and_part(facts, want):
    from dflop_jax.programs.devices import attention_kernels

    got = attention_kernels(*facts)
    assert (got.vision, got.llm) == want
    if facts[0] == "gpu":  # the XLA path is never auto's pick on a GPU (attention_hint's premise)
        assert "xla" not in want


def test_auto_is_the_default_and_resolves_to_xla_on_this_cpu():
    cfg = ModelConfig()
    assert cfg.attention_impl == "auto" and cfg.attention_kernels() == ("xla", "xla")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    assert (model_cfg.vision.attention_impl, model_cfg.text.attention_impl) == ("xla", "xla")


@pytest.mark.parametrize("source", ["built", "arch", "decoder"])
def test_the_model_config_carries_the_resolved_kernels(monkeypatch, source):
    """What "auto" resolves to is what the model config (and so the memory model, cost table and
    profiler hash) sees; a part set by hand keeps its kernel."""
    from dflop_jax.programs import devices as device

    monkeypatch.setattr(device, "local_attention_kernels",
                        lambda: device.AttentionKernels("cudnn", "pallas"))  # fmt: skip
    keys = {"arch": "siglip-so400m+qwen2.5-7b"} if source == "arch" else {}
    keys |= {"kind": "decoder"} if source == "decoder" else {}
    model_cfg = ModelConfig(**keys).model_config(100, tile_px=56, patch_size=14,
                                                 compute_dtype="float32")  # fmt: skip
    if source == "decoder":
        assert model_cfg.attention_impl == "pallas"
        return
    assert (model_cfg.vision.attention_impl, model_cfg.text.attention_impl) == ("cudnn", "pallas")
    by_hand = ModelConfig(**keys, vision_attention_impl="xla")
    assert by_hand.attention_kernels() == ("xla", "pallas")
    assert ModelConfig(
        **keys, attention_impl="cudnn", vision_attention_impl="auto"
    ).attention_kernels() == ("cudnn", "cudnn")


def test_auto_asks_the_device_once_per_process(monkeypatch):
    import types

    import jax

    from dflop_jax.programs import devices as device

    asked = []

    def devices():
        asked.append(1)
        return [types.SimpleNamespace(platform="gpu", compute_capability="8.0")]

    device.local_attention_kernels.cache_clear()
    monkeypatch.setattr(jax, "devices", devices)
    try:
        first, second = device.local_attention_kernels(), device.local_attention_kernels()
    finally:
        device.local_attention_kernels.cache_clear()
    assert first == second == device.AttentionKernels("pallas", "pallas") and len(asked) == 1


def test_a_bad_vision_attention_impl_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model.vision_attention_impl='flash': use one of"):
        from_dict(TrainConfig, {"model": {"vision_attention_impl": "flash"}})


def test_a_bad_attention_impl_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model.attention_impl='flash': use one of \['xla'"):
        from_dict(TrainConfig, {"model": {"attention_impl": "flash"}})


def test_an_hf_dir_brings_its_tokenizer_unless_another_is_given(tmp_path):
    import shutil

    from dflop_jax.data.tokenizer import ASSET

    hf, other = tmp_path / "hf", tmp_path / "tok"
    for d in (hf, other):
        d.mkdir()
        shutil.copy(ASSET, d / "tokenizer.json")
    (hf / "config.json").write_text("{}")
    cfg = from_dict(TrainConfig, {"model": {"hf_dir": str(hf)}})
    assert cfg.data.tokenizer == str(hf)
    given = from_dict(
        TrainConfig, {"model": {"hf_dir": str(hf)}, "data": {"tokenizer": str(other)}}
    )
    assert given.data.tokenizer == str(other)
    (hf / "tokenizer.json").unlink()  # a weights-only directory: the bundled tokenizer stays
    assert from_dict(TrainConfig, {"model": {"hf_dir": str(hf)}}).data.tokenizer == "bundled"


def test_an_arch_section_records_the_architectures_sizes():
    """run_dir/config.yaml's model section (`with_sizes_of`) says the named architecture's sizes;
    a section built from its fields is already what it builds."""
    from dflop_jax.costs import get_arch

    cfg = ModelConfig(arch="siglip-so400m+qwen2.5-7b")
    model_cfg = cfg.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32")
    recorded, arch = cfg.with_sizes_of(model_cfg), get_arch(cfg.arch)
    assert (recorded.hidden_size, recorded.num_layers, recorded.num_kv_heads) == (
        arch.llm.hidden_size, arch.llm.num_layers, arch.llm.num_kv_heads
    )  # fmt: skip
    assert (recorded.vision_hidden_size, recorded.vision_num_layers) == (
        arch.vision.hidden_size, arch.vision.num_layers
    )  # fmt: skip
    assert recorded.vocab_size == arch.llm.vocab_size and recorded.hidden_size != cfg.hidden_size
    assert (
        recorded.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32") == model_cfg
    )
    built = ModelConfig(kind="decoder")
    assert built.with_sizes_of(built.model_config(100, tile_px=56, patch_size=14,
                                                  compute_dtype="float32")) is built  # fmt: skip


@pytest.mark.parametrize("kind", ["llava_ov", "decoder"])
def test_the_plan_print_names_the_kernels_the_model_runs(kind):
    """`train`'s plan print has one line with the resolved kernels of each part."""
    import types

    import numpy as np
    from rich.console import Console

    from dflop_jax.contracts import BucketSet
    from dflop_jax.contracts.layout import Layout, StageSpec
    from dflop_jax.costs import AnalyticCostProvider, arch_of_model, get_device
    from dflop_jax.planner.resolve import ResolvedPlan
    from dflop_jax.runtime.trainer import _print_plan

    cfg = ModelConfig(kind=kind, attention_impl="pallas", vision_attention_impl="cudnn")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    plan = ResolvedPlan(
        Layout((), (StageSpec("llm", 0, 4, 1, 1, True, True),)),
        BucketSet((2,), (64,)),
        (1, 2),
        AnalyticCostProvider(arch_of_model(model_cfg), get_device("cpu")),
    )
    meshes = [types.SimpleNamespace(devices=np.array([types.SimpleNamespace(id=0)]))]
    console = Console(record=True, width=200)
    _print_plan(console, plan, meshes, model_cfg)
    want = "attention: vision=cudnn llm=pallas" if kind != "decoder" else "attention: llm=pallas"
    assert want in console.export_text().splitlines()[-1]


# --- model.llm_layers_kept: a real architecture cut to its first decoder layers ----------------------


def test_llm_layers_kept_cuts_the_decoder_and_keeps_the_rest():
    """The arch's first N decoder layers, its whole tower, embedding and head; config.yaml records
    the cut model (and loads back to it); plan files name it apart from the named architecture."""
    from dflop_jax.costs import arch_of_model, get_arch
    from dflop_jax.resolve.run_context import run_name

    name = "siglip-so400m+qwen2.5-7b"
    whole = ModelConfig(arch=name).model_config(100, tile_px=384, patch_size=14,
                                                compute_dtype="float32")  # fmt: skip
    cfg = ModelConfig(arch=name, llm_layers_kept=5)
    cut = cfg.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32")
    assert cut.text.num_layers == 5 and whole.text.num_layers == get_arch(name).llm.num_layers == 28
    assert cut.vision == whole.vision and cut.text.replace(num_layers=28) == whole.text
    # costs, FLOPs and MFU are the cut model's
    assert (
        arch_of_model(cut).llm.num_layers == 5
        and arch_of_model(cut).vision == arch_of_model(whole).vision
    )
    recorded = cfg.with_sizes_of(cut)
    assert (recorded.num_layers, recorded.llm_layers_kept) == (5, 5)
    assert recorded.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32") == cut
    train = from_dict(TrainConfig, {"model": {"arch": name, "llm_layers_kept": 5}})
    assert run_name(train) == f"{name}-llm5"
    assert run_name(from_dict(TrainConfig, {"model": {"arch": name}})) == name


@pytest.mark.parametrize(
    "model, match",
    [
        (
            {"arch": "siglip-so400m+qwen2.5-7b", "llm_layers_kept": 29},
            r"siglip-so400m\+qwen2.5-7b has 28 decoder layers: keep 1\.\.28",
        ),
        ({"arch": "siglip-so400m+qwen2.5-7b", "llm_layers_kept": -1}, r"0 \(every layer\)"),
        ({"llm_layers_kept": 2}, r"it cuts model.arch or model.hf_dir.*model.num_layers"),
    ],
)
def test_a_bad_llm_layers_kept_is_one_config_error(model, match):
    with pytest.raises(ConfigError, match=r"^model.llm_layers_kept=-?\d+: " + match):
        from_dict(TrainConfig, {"model": model})


@pytest.mark.hf
def test_a_cut_hf_checkpoint_loads_its_first_layers_and_its_head(tmp_path):
    """From an HF directory the cut model's LLM stage holds the checkpoint's first N layers, its
    embedding, final norm and LM head, bit for bit; the tower is whole; more layers than the
    checkpoint has is one config error."""
    pytest.importorskip("transformers")
    import jax
    import jax.numpy as jnp
    import models_fixtures as fx
    import numpy as np

    from dflop_jax.contracts.layout import Layout, StageSpec
    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.stage_builder import build_stages

    path = str(fx.save_tiny_llava_ov(tmp_path / "ov", layers=5))
    built = {}
    for n in (0, 2):
        cfg = ModelConfig(hf_dir=path, llm_layers_kept=n)
        model_cfg = cfg.model_config(0, tile_px=28, patch_size=7, compute_dtype="float32")
        layers = model_cfg.text.num_layers
        layout = Layout((StageSpec("encoder", 0, 5, 1, 1, has_embedding=True, has_head=True),),
                        (StageSpec("llm", 0, layers, 1, 1, has_embedding=True, has_head=True),))  # fmt: skip
        stages = build_stages(model_cfg, layout, stage_meshes(layout), path,
                              compute_dtype=jnp.float32)  # fmt: skip
        flat = lambda s: {  # noqa: E731
            jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(s.params))[0]
        }
        built[n] = (layers, [flat(s) for s in stages])
    (whole_layers, (whole_enc, whole_llm)), (cut_layers, (cut_enc, cut_llm)) = built[0], built[2]
    assert (whole_layers, cut_layers) == (5, 2)
    assert cut_enc.keys() == whole_enc.keys()
    for key, value in cut_enc.items():
        np.testing.assert_array_equal(value, whole_enc[key], err_msg=key)
    shorter = 0
    for key, value in cut_llm.items():
        want = whole_llm[key]
        if value.shape != want.shape:  # stacked layers: the first 2 of 5
            assert (value.shape[0], want.shape[0]) == (2, 5), key
            want, shorter = want[:2], shorter + 1
        np.testing.assert_array_equal(value, want, err_msg=key)
    assert shorter or set(whole_llm) > set(cut_llm)  # the later layers are not there
    assert any("norm" in k for k in cut_llm) and any("lm_head" in k or "head" in k for k in cut_llm)
    with pytest.raises(
        ConfigError, match=r"model.llm_layers_kept=6: the model has 5 decoder layers"
    ):
        ModelConfig(hf_dir=path, llm_layers_kept=6).model_config(
            0, tile_px=28, patch_size=7, compute_dtype="float32"
        )


def test_an_export_of_a_cut_model_leaves_the_later_decoder_layers_out():
    """The unread source tensors an export copies: not the decoder layers past the cut (the
    exported config.json says the cut's count); the tower's unread layers and heads stay."""
    from dflop_jax.runtime.hf_export import without_cut_layers

    lm, vt = "model.language_model.", "model.vision_tower.vision_model.encoder."
    tensors = {f"{lm}layers.{i}.mlp.up_proj.weight" for i in range(2)} | {
        f"{vt}layers.{i}.mlp.fc1.weight" for i in range(3)} | {f"{lm}norm.weight", "lm_head.weight"}  # fmt: skip
    kept = {f"{lm}layers.2.mlp.up_proj.weight": "a", f"{lm}layers.11.self_attn.q_proj.bias": "b",
            f"{vt}layers.3.mlp.fc1.weight": "c", "model.vision_tower.head.probe": "d",
            f"{lm}layers.1.extra": "e"}  # fmt: skip
    assert without_cut_layers(kept, tensors) == {
        f"{vt}layers.3.mlp.fc1.weight": "c", "model.vision_tower.head.probe": "d",
        f"{lm}layers.1.extra": "e"}  # fmt: skip
