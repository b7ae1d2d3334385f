"""Import boundaries of DESIGN section 2 / STYLE (b)2: the planning brain imports no jax or flax,
and models/ imports nothing from dflop_jax."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE_PACKAGES = ["dflop_jax.scheduler", "dflop_jax.planner", "dflop_jax.sim", "dflop_jax.costs"]


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
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "dflop_jax"]
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
