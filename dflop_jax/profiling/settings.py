"""`ProfileSettings` lives in `dflop_jax.contracts.profile_settings` (the runtime's config composes it
without importing the profiler); re-exported here for the profiler's modules."""

from dflop_jax.contracts.profile_settings import ProfileSettings

__all__ = ["ProfileSettings"]
