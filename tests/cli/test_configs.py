"""Every YAML in configs/ loads into the root config of the command its header names (STYLE (b)11).

A config's first comment lines show how to run it (`python -m dflop_jax.<entry> ...`); that entry
point's root dataclass must accept the file as written.
"""

import re
from pathlib import Path

import pytest

from dflop_jax.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _root_for(command: str):
    if command.startswith(("dflop_jax.train", "dflop_jax.plan", "dflop_jax.profile")):
        from dflop_jax.runtime.config import TrainConfig

        return TrainConfig  # the run config every step of a run reads
    raise AssertionError(f"no root config known for `python -m {command}`: add it to {__file__}")


def test_there_are_configs():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_into_its_entry_points_schema(path):
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    m = re.search(r"python -m (dflop_jax[\w.]*(?: data| model| auto)?)", header)
    if path.name == "demo.yaml":
        command = "dflop_jax.train"
    else:
        assert m, f"{path.name}: the header comment must show its command (python -m dflop_jax...)"
        command = m.group(1)
    root = _root_for(command)
    assert isinstance(
        load_config(root, path), root
    )  # load_config raises ConfigError on any problem
