"""Import boundaries of DESIGN section 2 / STYLE (b)2: the planning brain imports no jax or flax,
models/ imports nothing from dflop_jax, and dflop_jax's packages depend on each other one way only.

DESIGN draws data flowing `models <- programs <- runtime; data -> scheduler -> runtime; profiling ->
planner -> scheduler`. As imports (every import in the source, lazy ones inside functions included):
the shared contracts (sample shape, bucket set, schedule, the shape-distribution and cost-table file
formats, profile settings) sit at the bottom; the data layer and the scheduler meet only in those
contracts; the compiled programs (`programs/`) sit under both the profiler and the runtime, which
import nothing of each other: the profiler times the programs the runtime trains and hands its tables
to the planner; the runtime uses data, scheduler and planner results; entry points
(`dflop_jax/<name>.py`) and `bench` sit on top.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflop_jax"
PURE_PACKAGES = [
    "dflop_jax.contracts",
    "dflop_jax.scheduler",
    "dflop_jax.planner",
    "dflop_jax.sim",
    "dflop_jax.costs",
]
# package -> the dflop_jax packages (and low helper modules) it may import
ALLOWED = {
    "config": set(),
    "host_devices": set(),
    "contracts": {"config"},
    "costs": {"config", "contracts"},
    "sim": {"config", "contracts"},
    "data": {"config", "contracts"},
    "scheduler": {"config", "contracts", "costs", "sim"},
    "planner": {"config", "contracts", "costs", "scheduler", "sim"},
    "programs": {"config", "contracts", "costs"},
    "runtime": {"config", "contracts", "costs", "data", "scheduler", "planner", "programs"},
    "profiling": {"config", "contracts", "costs", "data", "planner", "programs", "host_devices"},
    # a run config resolved once per command: joins the planner, the profiler and the runtime's config
    "resolve": {
        "config",
        "contracts",
        "costs",
        "data",
        "planner",
        "programs",
        "profiling",
        "runtime",
    },
}


def _imported_modules(path: Path) -> list[str]:
    """Absolute module names imported anywhere in `path` (relative imports resolved)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from dflop_jax import profile` imports the module dflop_jax.profile
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return out


def _unit(module: str) -> str | None:
    """The dflop_jax package (or top-level module) a module belongs to; None outside dflop_jax."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dflop_jax" and len(parts) > 1 else None


def import_graph() -> dict[str, set[str]]:
    """unit -> units it imports, over dflop_jax's source files (a unit: a subpackage or a top-level
    module such as an entry point)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        src = rel[0] if len(rel) > 1 else path.stem
        if src == "__init__":
            continue
        deps = {_unit(m) for m in _imported_modules(path)} - {None, src}
        graph.setdefault(src, set()).update(deps)
    return graph


def test_import_graph_sees_known_edges():
    graph = import_graph()  # guards the parser: these edges exist by design
    assert "contracts" in graph["data"] and "scheduler" in graph["planner"]
    assert "runtime" in graph["train"] and "programs" in graph["profiling"]


def test_no_cycles_between_packages():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, dep])}")
            if dep not in state:
                visit(dep, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_is_below_it(package):
    extra = import_graph().get(package, set()) - ALLOWED[package]
    assert not extra, (
        f"dflop_jax.{package} imports {sorted(extra)}: not below it (DESIGN section 2)"
    )


def test_every_package_has_a_rule():
    """Entry points and bench may import anything; every other package is placed in ALLOWED."""
    graph = import_graph()
    entry_points = {p.stem for p in PACKAGE.glob("*.py")} | {"bench"}
    assert set(graph) - entry_points <= set(ALLOWED), sorted(
        set(graph) - entry_points - set(ALLOWED)
    )


def test_contracts_import_nothing_above_them():
    for path in (PACKAGE / "contracts").rglob("*.py"):
        units = {_unit(m) for m in _imported_modules(path)} - {None}
        assert units <= {"contracts", "config"}, f"{path.name} imports {sorted(units)}"


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_do_not_import_jax(package):
    code = (
        "import sys, importlib, pkgutil\n"
        f"pkg = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'flax', 'jaxlib', 'optax'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "", f"{package} pulls in {out.stdout.strip()}"


def test_models_do_not_import_dflop_jax():
    offenders = []
    for path in (ROOT / "models").rglob("*.py"):
        offenders += [
            f"{path.name}: {m}" for m in _imported_modules(path) if m.split(".")[0] == "dflop_jax"
        ]
    assert not offenders, offenders


# What a clone cannot reach, built from parts so that this file does not match its own patterns:
# the folder beside a checkout, the old environment variable pointing there, the statistics outside
# dflop_jax/data/, an absolute path into a shared folder, and the design outside docs/.
_SHARED = "shared"
OUTSIDE_REFERENCES = re.compile(
    "|".join(
        [
            re.escape("../" + _SHARED),
            "DFLOP_" + _SHARED.upper() + "_DIR",
            re.escape(_SHARED + "/workload_stats"),
            r"(?:^|[\s=:\"'(\[`])(?:/[\w.-]+)*/" + _SHARED + "/",
            re.escape(_SHARED + "/") + "(?:DESIGN|STYLE)[.]md",
        ]
    )
)
_BINARY_SUFFIXES = {".gz", ".png", ".jpg", ".jpeg", ".mp4", ".npz", ".npy", ".pkl", ".safetensors"}
_UNTRACKED_DIRS = {".git", ".venv", "runs", "data_cache", "build", "__pycache__", ".pytest_cache"}


def _project_files() -> list[Path]:
    """Tracked files (`git ls-files`); in a copy without git (an archive), every file of the tree."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True
        )
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT.resolve():
            out = subprocess.run(
                ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
            )
            return [ROOT / name for name in out.stdout.split("\0") if name]
    except FileNotFoundError:  # no git on this machine
        pass
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and not _UNTRACKED_DIRS.intersection(p.relative_to(ROOT).parts)
        and not any(part.endswith((".egg-info", "_cache")) for part in p.parts)
    ]


def test_nothing_reaches_outside_the_repository():
    """A clone with nothing beside it must work: no file names a folder next to the checkout."""
    files = [p for p in _project_files() if p.suffix not in _BINARY_SUFFIXES and p.is_file()]
    assert any(p.name == "workloads.py" for p in files)  # the scan sees the code
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_REFERENCES.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_outside_reference_pattern():
    """The scan's pattern catches each way of reaching out, and not the in-repo statistics path."""
    bad = [
        "Design: [DESIGN](../" + _SHARED + "/DESIGN.md)",
        "os.environ['DFLOP_" + _SHARED.upper() + "_DIR']",
        "see " + _SHARED + "/workload_stats/omnibal_internvl",
        "cache_dir=/" + _SHARED + "/profiles/tiny",
        "read /work/" + _SHARED + "/DESIGN.md first",
        "see " + _SHARED + "/STYLE.md",
    ]
    good = [
        "dflop_jax/data/workload_stats/omnibal_internvl",
        "cache_dir=/nfs/profiles/tiny",
        "files in a shared directory",
        "runtime/" + _SHARED + "_state.py",
        "runs/" + _SHARED + "/out.json",
    ]
    assert all(OUTSIDE_REFERENCES.search(s) for s in bad)
    assert not any(OUTSIDE_REFERENCES.search(s) for s in good)
