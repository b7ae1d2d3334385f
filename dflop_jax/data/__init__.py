"""Data layer: sources, processing, shape metadata, synthetic data, packing and the grain loader."""

# Packing and loader (data-B); data-A adds the sources/processing names.
from dflop_jax.data.loader import (
    Loader,
    PackSpec,
    SchedulerHook,
    build_dataset,
    make_loader,
    pack_geometry,
)
from dflop_jax.data.packing import HostShardSpec, needed_samples, pack_global_batch, pack_microbatch

__all__ = [
    "HostShardSpec",
    "Loader",
    "PackSpec",
    "SchedulerHook",
    "build_dataset",
    "make_loader",
    "needed_samples",
    "pack_geometry",
    "pack_global_batch",
    "pack_microbatch",
]
