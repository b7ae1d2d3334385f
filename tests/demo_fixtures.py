"""The demo (configs/demo.yaml) at the least it allows, for the tests that train it with `plan: auto`
where neither the profile grid nor the search is the subject: one tp, one profiled bucket per part,
a few samples (of the demo's sizes: shorter ones would skip most records), one planner sample, one
bucket per ladder (a run compiles its stages once: most of its time), no checkpoints.

Every such test passes the same list (plus its own keys after it), so their programs are the same
where their layouts are, and the run's one compilation cache (tests/conftest.py) compiles each once:
`compilation_cache=` leaves the cache to the JAX_COMPILATION_CACHE_DIR the run set (in-process and in
the jax processes a test starts). A program is keyed by its HLO and devices, not by the run's device
count."""

SMALL_DEMO = [
    "data.synth_samples=48",
    "data.cache_dir=",
    "global_batch=4",
    "profile.tps=[1]",
    "profile.encoder_buckets=[4]",
    "profile.llm_buckets=[512]",
    "profile.warmup=0",
    "profile.runs=1",
    "planner.tp=[1]",
    "planner.microbatches=[2]",
    "planner.samples=1",
    "planner.num_buckets=[1]",
    "planner.screen_top=2",
    "planner.top_n=1",
    "checkpoint.every=0",
    "compilation_cache=",
]
