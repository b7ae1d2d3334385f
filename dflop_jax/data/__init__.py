"""Data layer: sources, processing, shape metadata, synthetic data, packing and the grain loader."""

# data-A: config, errors, metadata, mix, process, sources, synth, tokenizer. data-B: loader, packing.
from dflop_jax.data.bad_sample import REASONS, BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.loader import (
    Loader,
    PackSpec,
    build_dataset,
    make_loader,
    pack_geometry,
)
from dflop_jax.data.metadata import MetadataCache
from dflop_jax.data.mix import load_mix
from dflop_jax.data.packing import HostShardSpec, needed_samples, pack_global_batch, pack_microbatch
from dflop_jax.data.process import Processor
from dflop_jax.data.sources import read_records
from dflop_jax.data.synth import synth_dataset
from dflop_jax.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "REASONS",
    "BadSample",
    "DataConfig",
    "MetadataCache",
    "Processor",
    "Tokenizer",
    "load_mix",
    "load_source",
    "load_tokenizer",
    "read_records",
    "synth_dataset",
    "HostShardSpec",
    "Loader",
    "PackSpec",
    "build_dataset",
    "make_loader",
    "needed_samples",
    "pack_geometry",
    "pack_global_batch",
    "pack_microbatch",
]
