"""Every field of every entry point's root config, given wrong types and out-of-range values.

Each bad value must end in one clean `ConfigError` naming the field (the person's dotted key), never a
TypeError / AttributeError from deep code, and never be accepted where it is out of range. Runs the
loader in-process (fast); `test_entry_errors.py` checks the entry points' exit codes.
"""

import dataclasses
import math
import re
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest

from dflop_jax.config import ConfigError, from_dict, load_config


def _roots() -> dict[str, type]:
    from dflop_jax.runtime.config import TrainConfig

    return {"train, plan, profile": TrainConfig}  # the run config every step of a run reads


def leaves(cls: type, prefix: str = ""):
    """(dotted key, type) of every non-dataclass field under `cls`."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            yield from leaves(tp, key)
        else:
            yield key, tp


def _base(tp):
    """The type without its `| None`."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def wrong_types(tp) -> list:
    """Values no field of type `tp` may accept."""
    tp = _base(tp)
    origin = get_origin(tp)
    mapping = {"not": "a value"}
    if origin is Literal:
        return ["no-such-choice", 12345, [tp.__args__[0]], mapping]
    if origin is tuple:
        elem = get_args(tp)[0]
        bad_elem = ["x"] if elem in (int, float) else [[1]]
        return [mapping, bad_elem, [mapping]]
    if origin is dict:
        return [["a"], "x", 1.5, {"key": "fast"}, {"key": [1.0]}]
    return {
        int: ["four", 1.5, True, [1, 2], mapping, float("nan")],
        float: ["fast", True, [1.0], mapping, float("nan"), float("inf")],
        bool: ["maybe", 2, [True], mapping],
        str: [[1, 2], mapping, True],
        Path: [[1], mapping, 3],
    }[tp]


def out_of_range(tp) -> list:
    """Values that are the right type but often outside a field's range."""
    tp = _base(tp)
    origin = get_origin(tp)
    if origin is Literal:
        return []
    if origin is dict:
        return [{}, {"no-such-name": 1.0}, {"vision": -1.0}, {"vision": 0.0}, {"vision": 1e30}]
    if origin is tuple:
        args = get_args(tp)
        if args[0] is str:
            return [[], ["no-such-name"]]
        if args[-1] is Ellipsis:
            return [[], [0], [-1], [3, 1], [2, 2], [10**12]]
        return [[0, 0], [-1, 2], [5, 2], [10**12, 10**12]]
    return {
        int: [-1, 0, -(10**9), 10**12],
        float: [-1.0, 0.0, -1e30, 1e30],
        bool: [],
        str: ["", "no/such/thing.json"],
        Path: [""],
    }[tp]


# A valid starting point per entry point where its defaults alone are not one.
BASE: dict[str, dict] = {}


def nested(entry: str, key: str, value) -> dict:
    """The entry's base config data with `key` set to `value`."""
    data = _copy(BASE.get(entry, {}))
    node, parts = data, key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


def _copy(d: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def names_key(message: str, key: str) -> bool:
    """The message names `key` (a cross-field error may lead with the other key of the pair)."""
    return key in message


CASES = [(entry, key, tp) for entry, root in _roots().items() for key, tp in leaves(root)]


@pytest.mark.parametrize("entry, key, tp", CASES, ids=[f"{e}:{k}" for e, k, _ in CASES])
def test_wrong_types_are_clean_errors_naming_the_field(entry, key, tp):
    root = _roots()[entry]
    for value in wrong_types(tp):
        with pytest.raises(ConfigError) as e:
            from_dict(root, nested(entry, key, value))
        message = str(e.value)
        assert names_key(message, key), f"{key}={value!r} -> {message}"
        assert "\n" not in message


@pytest.mark.parametrize("entry, key, tp", CASES, ids=[f"{e}:{k}" for e, k, _ in CASES])
def test_out_of_range_values_load_or_fail_cleanly(entry, key, tp):
    root = _roots()[entry]
    for value in out_of_range(tp):
        try:
            from_dict(root, nested(entry, key, value))
        except ConfigError as e:
            assert names_key(str(e), key), f"{key}={value!r} -> {e}"
            assert "\n" not in str(e)


def sections(cls: type, prefix: str = ""):
    """Dotted keys of every nested config section under `cls`."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            key = f"{prefix}.{field.name}" if prefix else field.name
            yield key
            yield from sections(hints[field.name], key)


SECTIONS = [(entry, key) for entry, root in _roots().items() for key in sections(root)]


@pytest.mark.parametrize("entry, key", SECTIONS, ids=[f"{e}:{k}" for e, k in SECTIONS])
def test_a_section_given_a_value_is_a_clean_error(entry, key):
    shorthand = getattr(section_type(_roots()[entry], key), "SHORTHAND", None)
    for value in (3, "text", [1, 2]):
        # a section with a shorthand key (`device: h100`) reads a string as that key's value
        expected = (
            f"{key}.{shorthand}=" if shorthand and value == "text" else f"{key}: expected a mapping"
        )
        with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
            from_dict(_roots()[entry], nested(entry, key, value))


def section_type(cls: type, key: str) -> type:
    for part in key.split("."):
        cls = get_type_hints(cls)[part]
    return cls


# Fields where a negative number means something (process_id -1: from the environment).
# -1 is a sentinel there: the process id from the environment, the automatic decode-worker count.
NEGATIVE_OK = {"distributed.process_id", "data.decode_workers"}


def test_decode_workers_below_the_auto_sentinel_are_rejected():
    from dflop_jax.runtime.config import TrainConfig

    with pytest.raises(ConfigError, match="data.decode_workers"):
        from_dict(TrainConfig, {"data": {"decode_workers": -2}})


NUMBERS = [(e, k) for e, k, tp in CASES if _base(tp) in (int, float) and k not in NEGATIVE_OK]


@pytest.mark.parametrize("entry, key", NUMBERS, ids=[f"{e}:{k}" for e, k in NUMBERS])
def test_negative_numbers_are_rejected(entry, key):
    with pytest.raises(ConfigError) as e:
        from_dict(_roots()[entry], nested(entry, key, -1))
    assert names_key(str(e.value), key)


def test_nan_is_never_a_number():
    from dflop_jax.runtime.config import TrainConfig

    with pytest.raises(ConfigError, match=r"optimizer.lr: expected a finite number, got nan"):
        from_dict(TrainConfig, {"optimizer": {"lr": math.nan}})


# Raw command-line values: YAML-parsed as an override would be (.inf / .nan are YAML floats).
RAW = ["", "[", "{a: 1}", "-1", ".inf", ".nan", "0", "[1, x]"]


@pytest.mark.parametrize("entry, key, tp", CASES, ids=[f"{e}:{k}" for e, k, _ in CASES])
def test_raw_override_strings_load_or_fail_cleanly(entry, key, tp):
    root = _roots()[entry]
    base = [f"{k}={v}" for k, v in _flat(BASE.get(entry, {}))]
    for raw in RAW:
        try:
            load_config(root, None, [*base, f"{key}={raw}"])
        except ConfigError as e:
            assert names_key(str(e), key), f"{key}={raw} -> {e}"


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        yield from _flat(v, key) if isinstance(v, dict) else [(key, v)]
