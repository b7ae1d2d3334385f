"""docs/config.md is generated from the config dataclasses and must be current and complete."""

import dataclasses
from pathlib import Path

from dflop_jax.config.reference import attribute_docs, render
from dflop_jax.config_reference import root_configs

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_attribute_docs_parse_google_style_entries():
    @dataclasses.dataclass
    class Example:
        """An example.

        Attributes:
          a: the first; b: the second.
          c, d: shared text
            that goes on.
          vision_*: every vision field.
        """

        a: int = 0

    docs = attribute_docs(Example)
    assert docs["a"] == "the first"
    assert docs["b"] == "the second."
    assert docs["c"] == docs["d"] == "shared text that goes on."
    assert docs["vision_*"] == "every vision field."


def test_config_reference_is_current():
    expected = render(root_configs())
    assert DOC.read_text() == expected, (
        "docs/config.md is stale: python -m dflop_jax.config_reference out=docs/config.md"
    )


def test_every_key_has_a_meaning():
    undocumented = [
        line.split("|")[1].strip()
        for line in render(root_configs()).splitlines()
        if line.startswith("| `") and line.rstrip().endswith("|  |")
    ]
    assert not undocumented, f"document these in their class's Attributes: {undocumented}"
