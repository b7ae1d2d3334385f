"""dflop_jax: data-driven profiling, planning, scheduling and MPMD pipeline training of multimodal LLMs."""

__version__ = "0.1.0"
