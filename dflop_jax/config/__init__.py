"""Typed configuration: dataclass schemas, YAML + overrides loading, validation."""

from dflop_jax.config.config_error import ConfigError
from dflop_jax.config.inputs import InputPath, check_inputs
from dflop_jax.config.parsing import (
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    read_yaml,
    require,
    require_seed,
    to_dict,
)

__all__ = [
    "ConfigError",
    "InputPath",
    "check_inputs",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_config",
    "read_yaml",
    "require",
    "require_seed",
    "to_dict",
]
