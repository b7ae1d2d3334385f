"""The profiler's access to `runtime.arch_model` (the `models` config of a named architecture), which
the training config's `model: <arch name>` shorthand uses too."""

from dflop_jax.runtime.arch_model import arch_for_model_config, model_config_for_arch

__all__ = ["arch_for_model_config", "model_config_for_arch"]
