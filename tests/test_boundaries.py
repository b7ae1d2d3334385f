"""Import boundaries of DESIGN section 2 / STYLE (b)2: the planning brain imports no jax or flax,
and models/ imports nothing from dflop_jax."""

import ast
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
