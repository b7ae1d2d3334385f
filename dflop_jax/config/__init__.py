"""Typed configuration: dataclass schemas, YAML + overrides loading, validation."""

from dflop_jax.config.loader import (
    ConfigError,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    read_yaml,
    require,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_config",
    "read_yaml",
    "require",
    "to_dict",
]
