"""The typed config loader: YAML + overrides + gin bindings, and its one-line errors."""

import dataclasses
from typing import Literal

import pytest

from dflop_jax.config import ConfigError, apply_overrides, dump_yaml, load_config, require, to_dict


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    heads: int = 4
    tp: int = 1
    rate: float = 0.5
    solver: Literal["greedy", "cpsat", "auto"] = "auto"
    buckets: tuple[int, ...] = (1, 2)

    def __post_init__(self):
        require(self.heads % self.tp == 0, "inner.tp", self.tp, f"must divide heads={self.heads}")


@dataclasses.dataclass(frozen=True)
class RootConfig:
    name: str = "x"
    path: str | None = None
    inner: InnerConfig = InnerConfig()


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides_typed_by_schema(tmp_path):
    p = write(tmp_path, "name: demo\ninner:\n  heads: 8\n")
    cfg = load_config(RootConfig, p, ["inner.tp=2", "inner.rate=1", "inner.buckets=4,8,16"])
    assert cfg.name == "demo"
    assert cfg.inner == InnerConfig(heads=8, tp=2, rate=1.0, buckets=(4, 8, 16))
    assert isinstance(cfg.inner.rate, float)


def test_defaults_when_no_file():
    assert load_config(RootConfig) == RootConfig()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "inner.hedas=3",
            "inner.hedas: unknown key; allowed keys of inner: buckets, heads, rate, solver, tp",
        ),
        ("inner.heads=four", "inner.heads: expected an integer, got 'four'"),
        (
            "inner.solver=magic",
            "inner.solver: 'magic' is not allowed; choose one of 'greedy', 'cpsat', 'auto'",
        ),
        ("inner.tp=3", "inner.tp=3: must divide heads=4"),
        ("name", "expected key=value"),
        ("name.sub=1", "name: expected a string, got {'sub': 1}"),
    ],
)
def test_errors_are_one_line_and_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RootConfig, None, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(RootConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(RootConfig, write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML") as e:  # yaml's own message spans lines
        load_config(RootConfig, write(tmp_path, "inner:\n  heads: [1,\n"))
    assert "\n" not in str(e.value)


def test_gin_bindings_are_overrides(tmp_path):
    gin = tmp_path / "b.gin"
    gin.write_text("# comment\ninner.tp = 2\nname = 'g'\n")
    cfg = load_config(RootConfig, None, ["inner.heads=8"], gin_files=[gin])
    assert (cfg.name, cfg.inner.tp, cfg.inner.heads) == ("g", 2, 8)
    gin.write_text("not a binding\n")
    with pytest.raises(ConfigError, match=r"b.gin:1: expected `key.sub = value`"):
        load_config(RootConfig, None, gin_files=[gin])


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(RootConfig, None, ["inner.buckets=[3,5]", "path=/x"])
    dump_yaml(cfg, tmp_path / "out.yaml")
    assert load_config(RootConfig, tmp_path / "out.yaml") == cfg
    assert to_dict(cfg)["inner"]["buckets"] == [3, 5]


def test_apply_overrides_does_not_mutate_input():
    data = {"inner": {"tp": 1}}
    out = apply_overrides(data, ["inner.tp=2"])
    assert data == {"inner": {"tp": 1}} and out == {"inner": {"tp": 2}}


def test_bare_on_off_reach_on_off_literals(tmp_path):
    """YAML 1.1 reads `on` / `off` as booleans; a field whose choices are "on"/"off" gets the words."""
    from dflop_jax.scheduler import SchedulerConfig

    @dataclasses.dataclass(frozen=True)
    class Root:
        scheduler: SchedulerConfig = SchedulerConfig()

    assert load_config(Root, None, ["scheduler.correction=on"]).scheduler.correction == "on"
    p = write(tmp_path, "scheduler:\n  correction: off\n")
    assert load_config(Root, p).scheduler.correction == "off"
    with pytest.raises(ConfigError, match="inner.solver: True is not allowed"):
        load_config(RootConfig, None, ["inner.solver=on"])  # no on/off choice: still an error
