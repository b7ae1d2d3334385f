"""No test module imports another: what tests share lives in a fixture module directly under tests/
(on pytest's pythonpath: `models_fixtures.py`, `pipeline_fixtures.py`, `multiprocess_launch.py`, ...).

A test module's helpers are its own to change: a test that imports them breaks when they do, and
finds them only while the importee's folder is on sys.path (pytest's pythonpath lists tests/ alone).
Every Python file under tests/ is read (the fixture modules and the workers that tests start
included), lazy imports inside functions too.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def imports_of_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a module named test_* in `source` (any dotted part)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.ImportFrom):  # `from . import test_x`
            modules = [alias.name for alias in node.names]
        else:
            continue
        hits += [
            (node.lineno, m) for m in modules if any(p.startswith("test_") for p in m.split("."))
        ]
    return hits


def test_the_check_finds_every_form_of_import():
    source = (
        "import test_a\n"
        "import test_b as b\n"
        "from test_c import helper\n"
        "from . import test_d\n"
        "def f():\n"
        "    from test_e import value\n"
        "import os, pytest\n"
        "from models_fixtures import tiny_decoder_config\n"
        "from pipeline_reference import test_tolerance\n"  # a name, not a module
    )
    found = sorted(m for _, m in imports_of_test_modules(source))
    assert found == ["test_a", "test_b", "test_c", "test_d", "test_e"]


def test_no_test_module_imports_another():
    files = sorted(TESTS.rglob("*.py"))
    assert any(f.name == "test_runtime_trainer.py" for f in files)  # the walk sees the test folders
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in files
        for line, module in imports_of_test_modules(path.read_text())
    ]
    assert not found, (
        "test modules import other test modules; move what they share into a fixture module "
        "under tests/:\n" + "\n".join(found)
    )
