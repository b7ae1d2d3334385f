"""What each `bench gpu` part runs at each size, the parts, and the goals its figures are held to.

The part descriptions are `dflop_jax/bench/gpu/__init__.py`'s docstring.
"""

from __future__ import annotations

import dataclasses

BENCH_PARTS = ("attention", "stage", "profiler", "host")  # the default
BY_NAME_PARTS = ("ops", "model", "model_blind")  # heavier, run when named (the GPU check does)
STAGE_MODULES = ("llm", "encoder")
CPU_BANNER = "CPU: figures are not GPU figures"
# Goals on one H100: the LLM stage's MFU (the stage part), and the profiler's stage-time
# prediction error, raw and corrected (the profiler part).
GOAL_LLM_MFU = 0.55
GOAL_RAW_MAPE, GOAL_CORRECTED_MAPE = 0.10, 0.05


@dataclasses.dataclass(frozen=True)
class Size:
    """What each part runs at one size.

    Attributes:
      attn_lengths: packed row lengths; attn_heads: (query heads, kv heads, head dim); attn_packed:
        samples of the packed case.
      arch: `costs.get_arch` name of the stage part; llm_layers / llm_tokens: its LLM stage;
        encoder_tiles: its vision stage's tile bucket (the whole tower with its patch embedding).
      profiler: overrides of `configs/demo.yaml` for the profiler part (the demo's model, plan: auto).
      host: TrainConfig overrides of the host part's decoder; host_layers: its layers (split over
        up to 2 pipeline stages); host_tokens: its packed row length.
      steps: training steps of the profiler and host parts (the first ones compile).
      model: overrides of `configs/llava_ov_7b_1gpu.yaml` for the model parts ((): as shipped);
        model_steps: their training steps.
    """

    attn_lengths: tuple[int, ...]
    attn_heads: tuple[int, int, int]
    attn_packed: int
    arch: str
    llm_layers: int
    llm_tokens: int
    encoder_tiles: int
    profiler: tuple[str, ...]
    host: tuple[str, ...]
    host_layers: int
    host_tokens: int
    steps: int
    model: tuple[str, ...] = ()
    model_steps: int = 30


_PROFILE_SMALL = ("profile.tps=[1]", "profile.encoder_buckets=[1, 2, 4]", "profile.llm_buckets=[128, 256, 512]",
                  "profile.warmup=1", "profile.runs=2", "data.max_tokens=512", "data.max_grid=1",
                  "data.max_frames=2", "data.synth_samples=64", "planner.tp=[1]",
                  "planner.encoder_pp=[1]", "planner.llm_pp=[1]", "planner.microbatches=[2, 4]",
                  "planner.num_buckets=[2]", "planner.samples=1", "planner.screen_top=2",
                  "planner.top_n=1", "global_batch=8")  # fmt: skip
# The CI smoke size: one profiled bucket per module (predictions scale with the bucket), one planned
# bucket pair and microbatch count (the fewest programs to compile), 2-layer decoder.
_PROFILE_SMOKE = (*_PROFILE_SMALL, "profile.encoder_buckets=[1]", "profile.llm_buckets=[256]",
                  "data.max_tokens=256", "profile.warmup=0", "profile.runs=1",
                  "planner.num_buckets=[1]", "planner.microbatches=[2]")  # fmt: skip
_HOST_SMALL = ("model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4",
               "model.num_kv_heads=2", "model.head_dim=16")  # fmt: skip
# The real model's parts at the CPU sizes: the tiny arch (56 px tiles), cut to 2 of its 4 decoder
# layers as the real config cuts Qwen2.5-7B, one profiled bucket per module, one bucket pair.
_MODEL_SMALL = ("model.arch=tiny", "model.llm_layers_kept=2", "data.tile_size=56", "data.max_grid=1",
                "data.max_frames=2", "data.max_tokens=256", "data.synth_samples=32",
                "profile.encoder_buckets=[1]", "profile.llm_buckets=[256]", "profile.warmup=0",
                "profile.runs=1", "planner.microbatches=[2]", "planner.num_buckets=[1]",
                "planner.samples=1", "global_batch=4")  # fmt: skip
_SMALL = dict(arch="tiny", attn_packed=16, host=_HOST_SMALL, host_layers=2, host_tokens=256,
              model=_MODEL_SMALL)  # fmt: skip
SIZES = {
    "smoke": Size(
        attn_lengths=(64, 128),
        attn_heads=(4, 2, 16),
        llm_layers=2,
        llm_tokens=128,
        encoder_tiles=2,
        profiler=_PROFILE_SMOKE,
        steps=3,
        model_steps=6,
        **_SMALL,
    ),
    "small": Size(
        attn_lengths=(128, 256),
        attn_heads=(4, 2, 32),
        llm_layers=4,
        llm_tokens=256,
        encoder_tiles=4,
        profiler=_PROFILE_SMALL,
        steps=6,
        model_steps=8,
        **_SMALL,
    ),
    "real": Size(
        attn_lengths=(4096, 8192),
        attn_heads=(28, 4, 128),
        attn_packed=16,
        arch="siglip-so400m+qwen2.5-7b",
        llm_layers=4,
        llm_tokens=8192,
        encoder_tiles=16,
        profiler=("global_batch=16", "planner.encoder_pp=[1]", "planner.llm_pp=[1]"),
        host=(
            "model.hidden_size=2048",
            "model.intermediate_size=5504",
            "model.num_heads=16",
            "model.num_kv_heads=4",
            "model.head_dim=128",
        ),
        host_layers=16,
        host_tokens=4096,
        steps=12,
    ),
}
