"""Test setup: 8 simulated CPU devices (before any JAX call), float32 matmuls for parity tests, XLA's
CPU backend at LLVM -O0, and one persistent compilation cache for the whole run."""

import importlib.metadata
import os
import shutil
import tempfile

from dflop_jax.host_devices import simulate_cpu_devices  # no jax


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without importing jax (whose XLA flags are set
    below, before its first import)."""
    major, minor = importlib.metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


simulate_cpu_devices(8)  # and the CPU client's thread pool for them (DESIGN 11)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # The suite's programs are tiny and compile-bound. LLVM's optimizations cost 2-3x the compile
    # time of a test-sized stage program and save less run time than that; XLA:CPU's MLIR fusion
    # emitters take most of what is left (the legacy emitters compile the demo's 96 stage programs
    # 2.5x faster; docs/design.md). Sharding, collectives and buffer assignment (what the tests
    # inspect) are decided in the HLO passes, before code generation. Inherited by every jax
    # process a test starts (`host_devices.own_devices_env` keeps all XLA flags but the device count).
    # jaxlib 0.11 knows no such flag, and an unknown XLA flag aborts the process: there the MLIR
    # emitters compile.
    legacy = " --xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 11) else ""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        + legacy
    ).strip()

import pytest  # noqa: E402

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = []  # the directory this process made (removed at the end), if any


def pytest_configure(config):
    """One JAX compilation cache for the run, set through the environment before the test modules
    import jax: in-process tests, every xdist worker (started later, they inherit the environment)
    and every jax process a test starts (the CLI and multi-process tests) share it, so a program
    compiled once (the tiny decoder's stages, say) is loaded, not compiled, everywhere after. Every
    program is cached however fast it compiles: most test programs compile in well under a second.
    A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as it is."""
    if _CACHE_ENV not in os.environ:
        path = tempfile.mkdtemp(prefix="dflop_jax_test_cache_")
        _OWN_CACHE.append(path)
        os.environ[_CACHE_ENV] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_first():
    """Compiles one program before any test, so this process's cache is the run's: JAX opens its
    cache at the first compile and keeps it, whatever directory a test's run config names later."""
    import jax

    jax.jit(lambda x: x + 1)(0).block_until_ready()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The session's one trained demo run (`demo_fixtures.DEMO_RUN`): its run directory. Under
    xdist the workers share it (their base temp directories have one parent)."""
    from demo_fixtures import train_demo_once

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return train_demo_once(shared / "demo_run")


def pytest_unconfigure(config):
    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    try:
        import jax

        has_gpu = any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def _longest_first(items):
    """Tests marked `seconds(n)` first, the longest first (the rest in their order): started last,
    one of them would run alone at the end of a parallel tier while the other worker idles
    (xdist hands out tests in collection order, where the slow tier's longest came last)."""

    def seconds(item):
        mark = item.get_closest_marker("seconds")
        return mark.args[0] if mark else 0

    items.sort(key=lambda item: -seconds(item))  # stable: the unmarked keep their order
