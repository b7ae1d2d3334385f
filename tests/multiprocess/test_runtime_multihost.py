"""Real `jax.distributed` processes on 127.0.0.1 (CPU, gloo) train the tiny LLaVA-OV and InternVL models
on a layout where the encoder's dp (1, at tp 2) differs from the LLM's (3) and the first LLM stage spans
processes: 2 processes x 4 devices (LLaVA-OV) and 4 x 2 (InternVL, where process 0 holds the encoder
alone) give the single-process run's per-step losses, and each process compiles, and decodes, only
its own share (`bench multihost` runs the processes). LLaVA-OV also with its tiles pooled
(`layout.pooled_tiles`): the encoder's shard and the first LLM stage's rows then hold tiles of any
row, gathered across processes."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflop_jax.bench.multihost import TINY_INTERNVL, TINY_LLAVA_OV, launch

MODELS = {
    "llava_ov": TINY_LLAVA_OV,
    "internvl": TINY_INTERNVL,
    # the pool holds the 3 rows' tiles: one bucket of 3 x 16
    "llava_ov_pooled": [*TINY_LLAVA_OV, "layout.pooled_tiles=true"],
}
TILES = {"llava_ov_pooled": 48}
_runs: dict[tuple[str, int], list[dict]] = {}  # each multi-process run, made once per session


def _overrides(tmp_path_factory, model: str) -> list[str]:
    synth = tmp_path_factory.getbasetemp() / f"synth_{model.removesuffix('_pooled')}"
    # One tile bucket (the layout's largest): what is tested is who compiles and decodes what.
    tiles = TILES.get(model, 16)
    return [*MODELS[model], f"data.synth_dir={synth}", "steps=2", f"layout.tiles=[{tiles}]"]


def _cache(tmp_path_factory, model: str, processes: int) -> Path:
    return tmp_path_factory.getbasetemp() / f"cache_{model}_{processes}p"


def _launch(tmp_path_factory, model: str, processes: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"{model}_{processes}p")
    cache = _cache(tmp_path_factory, model, processes) if processes > 1 else None
    return launch(processes, _overrides(tmp_path_factory, model), out, 400, cache=cache)


def _run(tmp_path_factory, model: str, processes: int, again: bool = False) -> list[dict]:
    """The run's reports; each run has a compilation cache of its own, which `again` (a second run
    of the same plan) finds filled by the first. A 2-process run and the single-process reference
    run side by side: two processes of a pipeline leave about a fifth of 2 cores idle (with 4 the
    cores are already over-subscribed, and the reference runs after them)."""
    counts = [n for n in {processes, 1} if (model, n) not in _runs]
    together = processes == 2 and len(counts) == 2
    with ThreadPoolExecutor(2 if together else 1) as pool:
        runs = {n: pool.submit(_launch, tmp_path_factory, model, n) for n in sorted(counts)}
    _runs.update({(model, n): run.result() for n, run in runs.items()})
    if not again:
        return _runs[model, processes]
    return launch(processes, _overrides(tmp_path_factory, model),
                  tmp_path_factory.mktemp(f"{model}_{processes}p_again"), 400,
                  cache=_cache(tmp_path_factory, model, processes))  # fmt: skip


def _reference(tmp_path_factory, model: str) -> dict:
    return _run(tmp_path_factory, model, 1)[0]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, processes", [("llava_ov", 2), ("internvl", 4), ("llava_ov_pooled", 2)]
)
def test_processes_train_like_one_and_do_their_share(tmp_path_factory, model, processes):
    reports = _run(tmp_path_factory, model, processes)
    single = _reference(tmp_path_factory, model)
    assert single["local_stages"] == [True, True, True]
    for r in reports:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
        # Stages without devices here run nothing, and XLA compiled only the local stages' programs,
        # all before step 1 (every bucket pair): fewer than the single process (every process
        # lacks a stage here).
        for here, n in zip(r["local_stages"], r["stage_compiles"]):
            assert (n > 0) == here
        assert r["xla_stage_programs_in_steps"] == 0
        assert r["programs_after_precompile"] == 0  # the reads' and update's programs too
        assert r["xla_stage_programs"] < single["xla_stage_programs"]
    # A stage spanning processes is one program on each of them: processes other than 0 share the
    # executable store, so the first of them to compile it writes it and a later one loads it
    # (InternVL's process 2, whose two stages both span, may load all of its stage programs).
    # Between them the processes compiled every stage's programs at least once.
    assert sum(r["xla_stage_programs"] for r in reports) >= single["xla_stage_programs"]
    # Devices: encoder [0, 1] (tp 2), LLM stage 0 [2, 3, 4] (spans processes), stage 1 [5, 6, 7].
    per_process = 8 // processes
    for r in reports:
        ids = range(r["process"] * per_process, (r["process"] + 1) * per_process)
        want = [any(d in ids for d in stage) for stage in ([0, 1], [2, 3, 4], [5, 6, 7])]
        assert r["local_stages"] == want
    # Decoding: together the processes decode every sample the single run decoded; one holding only
    # the encoder decodes exactly the samples with image tiles.
    everything = {i for i, _ in single["decoded"]}
    assert set().union(*({i for i, _ in r["decoded"]} for r in reports)) == everything
    for r in reports:
        if r["local_stages"] == [True, False, False]:
            assert {i for i, _ in r["decoded"]} == {i for i, t in single["decoded"] if t > 0}
            assert len(r["decoded"]) < len(single["decoded"])
    assert reports[0]["transfer_bytes"] == single["transfer_bytes"]
    if model.endswith("_pooled"):  # the same samples packed by row: the same math
        by_row = _reference(tmp_path_factory, model.removesuffix("_pooled"))
        assert single["losses"] == pytest.approx(by_row["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_second_run_loads_its_programs_on_every_process(tmp_path_factory):
    """JAX's persistent cache writes from process 0 only: process 1's programs (the second LLM
    stage's and its share of the first's stage programs, their parameters' and optimizer states'
    initialization, the optimizers' per-step programs, the update's statistics, the transfers and
    host reads, the learning rate's) come back from the executable store
    (`programs/executable_store.py`) in the same cache folder, so the second run of the same plan
    compiles nothing on any process, writes nothing new there, and trains the same losses. The
    first run is the 2-process LLaVA-OV run above."""
    first = _run(tmp_path_factory, "llava_ov", 2)
    store = tmp_path_factory.getbasetemp() / "cache_llava_ov_2p" / "dflop_executables"
    stored = {p: p.stat().st_mtime_ns for p in store.glob("*.pkl")}
    second = _run(tmp_path_factory, "llava_ov", 2, again=True)
    assert {p: p.stat().st_mtime_ns for p in store.glob("*.pkl")} == stored  # nothing rewritten
    assert [r["cache_hits"] for r in first] == [0, 0]
    assert first[1]["xla_stage_programs"] > 0
    optimizer = ("jit(update)", "jit(sq_norm)")  # the update's and the norm's programs
    assert all(first[1]["xla_compiled"].get(name) for name in optimizer)
    # process 0: every program from JAX's cache (its hits fire the compile event too); process 1:
    # every program it compiled in the first run loaded from the store, none compiled (the folder
    # also holds the start-up's, loaded before the worker counts)
    assert second[0]["cache_hits"] >= second[0]["xla_compiles"] == first[0]["xla_compiles"]
    assert second[1]["xla_compiled"] == {}
    assert len(stored) >= second[1]["cache_hits"] == first[1]["xla_compiles"]
    for a, b in zip(first, second):
        assert b["losses"] == a["losses"]
        assert b["programs_after_precompile"] == 0
