"""No private JAX APIs (`jax._src`) anywhere in dflop_jax/ or models/: GPU hosts run newer jax, where
private modules move without notice. Public replacements: `jax.experimental.multihost_utils`,
`jax.live_arrays`, files in a shared directory (see dflop_jax/programs/processes.py).

One exception, `ALLOWED`: models/cudnn_packed.py reaches cuDNN's packed attention layout, which no
public API offers; it imports the module lazily, checks the running jax against the versions whose
source was read, and the callers fall back to the Pallas kernels otherwise."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# `jax._src...` in any form (import, attribute, string for importlib) and `from jax import _src`.
PRIVATE = re.compile(r"\bjax\s*\.\s*_src\b|\bfrom\s+jax\s+import\s+[^\n]*\b_src\b|[\"']jax\._src")


ALLOWED = ("models/cudnn_packed.py",)


def _sources() -> list[Path]:
    files = [p for d in ("dflop_jax", "models") for p in sorted((REPO / d).rglob("*.py"))]
    files = [p for p in files if p.relative_to(REPO).as_posix() not in ALLOWED]
    assert len(files) > 20, f"found only {len(files)} sources: wrong repository root {REPO}?"
    return files


def test_pattern_catches_the_forms_it_must():
    for bad in (
        "from jax._src.distributed import global_state",
        "import jax._src.core as core",
        "x = jax._src.api.live_arrays()",
        "from jax import _src",
        'importlib.import_module("jax._src.distributed")',
    ):
        assert PRIVATE.search(bad), bad
    for ok in (
        "from jax.experimental import multihost_utils",
        "shapes_src = 1",
        "jax.live_arrays()",
    ):
        assert not PRIVATE.search(ok), ok


def test_no_private_jax_in_package_or_models():
    hits = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in _sources()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not hits, "private jax API used (use a public one):\n" + "\n".join(hits)


def test_the_one_allowed_module_imports_jax_src_lazily_and_once():
    """The exception stays one import, inside a function (a failed import is a fallback, not an
    error at import time of models/)."""
    (path,) = ALLOWED
    lines = (REPO / path).read_text(encoding="utf-8").splitlines()
    code = [
        line for line in lines if PRIVATE.search(line) and not line.lstrip().startswith(("#", "`"))
    ]
    imports = [line for line in code if "import" in line]
    assert len(imports) == 1 and imports[0].startswith("        "), imports
