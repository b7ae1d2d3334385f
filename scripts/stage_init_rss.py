"""Host peak RSS and seconds to make a pipeline's stage params: stage-local init vs the former
whole-model build (whole model on device 0, cut, every stage copied through the host).

    python scripts/stage_init_rss.py stage     # build_stages(model_cfg, layout, meshes, seed)
    python scripts/stage_init_rss.py whole     # the path train.run took before stage-local init
    python scripts/stage_init_rss.py none      # the floor: JAX started, nothing built

Each mode runs in its own process (peak RSS is per process) on 8 simulated CPU devices, where device
memory is host memory: RSS counts every placed stage param too. The model: a LLaVA-OV-style MLLM of
~120M params (SigLIP-style 6 x 512 ViT, 12 x 768 decoder, 16k vocabulary), fp32 masters, over
2 encoder stages (tp=1) and 3 LLM stages (tp=2): 8 devices.
"""

from __future__ import annotations

import os
import resource
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"


def _model_cfg():
    from models.decoder_config import DecoderConfig
    from models.llava_onevision import llava_onevision_config
    from models.siglip import SiglipConfig

    text = DecoderConfig(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=12,
                         num_heads=12, num_kv_heads=4, head_dim=64, dtype="bfloat16")  # fmt: skip
    vision = SiglipConfig(hidden_size=512, intermediate_size=2048, num_layers=6, num_heads=8,
                          image_size=224, patch_size=14, dtype="bfloat16")  # fmt: skip
    return llava_onevision_config(vision, text)


def _layout():
    from dflop_jax.contracts.layout import Layout, StageSpec

    enc = (
        StageSpec("encoder", 0, 3, has_embedding=True),
        StageSpec("encoder", 3, 3, has_head=True),
    )
    llm = (StageSpec("llm", 0, 4, tp=2, has_embedding=True), StageSpec("llm", 4, 4, tp=2),
           StageSpec("llm", 8, 4, tp=2, has_head=True))  # fmt: skip
    return Layout(enc, llm)


def _whole(cfg, layout, meshes):
    """The former path: `cfg.model.build` (eager init on device 0) + `build_mllm_stages`."""
    import jax
    from flax import nnx

    from dflop_jax.programs.stage_builder import stage_blueprint
    from dflop_jax.programs.stage_program import StageProgram
    from dflop_jax.programs.transfer import put_host
    from models.llava_onevision import LlavaOnevision
    from models.mllm import extract_stages

    with jax.default_device(jax.local_devices()[0]):
        model = LlavaOnevision(cfg, rngs=nnx.Rngs(0))
    encs, llms = extract_stages(
        model,
        [s.num_layers for s in layout.encoder_stages],
        [s.num_layers for s in layout.llm_stages],
    )
    programs = []
    for module, spec, mesh in zip(encs + llms, layout.stages, meshes):
        bp = stage_blueprint(module, cfg, spec, mesh)
        params = jax.tree.map(put_host, jax.device_get(bp.state), bp.shardings)
        programs.append(StageProgram(mesh, bp.fns, params))
    return model, programs


def main(mode: str) -> None:
    import jax

    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.stage_builder import build_stages

    cfg, layout = _model_cfg(), _layout()
    meshes = stage_meshes(layout)
    t0 = time.perf_counter()
    if mode == "stage":
        out = build_stages(cfg, layout, meshes, 0)
    elif mode == "whole":
        out = _whole(cfg, layout, meshes)
    else:
        out = None
    jax.block_until_ready(jax.tree.leaves([s.params for s in out[-1]] if mode == "whole" else
                                          [s.params for s in out or []]))  # fmt: skip
    seconds = time.perf_counter() - t0
    stages = out[-1] if mode == "whole" else out or []
    n = sum(int(a.size) for s in stages for a in jax.tree.leaves(s.params))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"{mode}: {n / 1e6:.1f}M stage params (replicas counted once per stage), "
          f"{seconds:.1f} s, peak RSS {rss:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stage")
