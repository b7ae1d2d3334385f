"""The config reference's text: every key of a root config with its type, default and meaning.

The schema's dataclasses are the one source: types and defaults come from their fields, meanings from
the `Attributes:` section of each class's docstring. The command that writes `docs/config.md` from
every command's root config is `python -m dflop_jax.config_reference`.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

HEADER = """# Config reference

Generated from the config dataclasses by `python -m dflop_jax.config_reference out=docs/config.md`
(do not edit by hand; a test checks it is current). Each command reads its root config from one YAML
file (`--config FILE`) and `key.sub=value` overrides; a key that is not listed under it is an error. A
training run's config (`train`) holds the model, data, device, profile, planner, scheduler, optimizer
and training sections; `plan`, `profile` and each benchmark (`bench NAME`) read configs of their own
(below).
Types: `a | b` is one of the listed values; `list of T` is a YAML list (on the command line `[1,2]`).
"""

# An `Attributes:` entry: "name: text", "a, b, c: text" or "prefix_*: text" at the entry indent.
_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][\w*]*(?:\s*,\s*[A-Za-z_][\w*]*)*)\s*:\s+(?P<text>.*)$")
# Two entries on one line: "steps: optimizer steps; global_batch: records drawn per step."
_SECOND_ENTRY = re.compile(r";\s+(?=[A-Za-z_]\w*:\s)")


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name (or `prefix_*` pattern) -> meaning, parsed from the class docstring's Attributes."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: list[list[str]] = []
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break
        if width == indent:  # an entry; its names may run on to the next line
            entries.append([line.strip()])
        elif entries:
            entries[-1].append(line.strip())
    out: dict[str, str] = {}
    for entry in entries:
        for part in _SECOND_ENTRY.split(" ".join(entry)):
            m = _ENTRY.match(part)
            if m:
                for name in m.group("names").split(","):
                    out[name.strip()] = m.group("text").strip()
    return out


def _meaning(docs: dict[str, str], name: str) -> str:
    if name in docs:
        return docs[name]
    for pattern, text in docs.items():
        if pattern.endswith("*") and name.startswith(pattern[:-1]):
            return text
    return ""


def type_name(tp: Any) -> str:
    """A reader's name for a field type: `int`, `a | b`, `list of int`, `map of str to float`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else ""
        )
    if origin in (tuple, list, typing.Sequence) or (origin and origin.__name__ == "Sequence"):
        inner = [a for a in args if a is not Ellipsis]
        return "list of " + (type_name(inner[0]) if len(set(map(str, inner))) == 1 else "values")
    if origin is dict or (origin and getattr(origin, "__name__", "") == "Mapping"):
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(str(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    return f"`{value}`"


def _sections(cls: type, prefix: str) -> list[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """(section key, class, rows) for `cls` and, depth first, every nested config dataclass."""
    hints = get_type_hints(cls)
    docs = attribute_docs(cls)
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = f"{prefix}{field.name}"
        default = _default(field)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            nested.append((key, type(default)))
            continue
        rows.append((key, type_name(hints[field.name]), _show(default), _meaning(docs, field.name)))
    out = [(prefix.rstrip("."), cls, rows)]
    for key, sub in nested:
        out += _sections(sub, key + ".")
    return out


def render(roots: list[tuple[str, type]]) -> str:
    """The whole reference, one part per command and its root config, as Markdown."""
    parts = [HEADER]
    for command, root in roots:
        parts.append(f"# `{command}`\n")
        for key, cls, rows in _sections(root, ""):
            title = f"`{key}`" if key else "Top level"
            summary = (inspect.getdoc(cls) or "").split("\n\n", 1)[0].replace("\n", " ")
            parts.append(
                f"## {command}: {title}\n\n{summary} (`{cls.__module__}.{cls.__qualname__}`)\n"
            )
            if rows:
                parts.append("| key | type | default | meaning |\n|---|---|---|---|")
                for name, tp, default, meaning in rows:
                    cell = " ".join(meaning.split()).replace("|", "\\|")
                    parts.append(f"| `{name}` | {tp} | {default} | {cell} |")
                parts.append("")
    return "\n".join(parts).rstrip() + "\n"
