"""Loss memory: compiled temporaries of loss + gradient, full-logits vs chunked cross-entropy.

    python -m dflop_jax.bench loss [batch=1 seq=8192 hidden=1024 vocab=152064]
                                   [chunks=512,1024,2048] [tp=1] [dtype=bfloat16]

Compiles (on CPU, from abstract shapes: nothing is materialized) value_and_grad w.r.t. the final
hidden states and the head weight of (a) `cross_entropy_sum(h @ W, ...)` (the [B,S,V] logits, upcast
to float32) and (b) `chunked_cross_entropy_sum(h, head, ..., chunk=c)`, and prints each program's
`memory_analysis()` temporaries per device. Hidden states are in `dtype` (the compute dtype), the
head weight is float32 (master weights) cast inside the head, as in `models.decoder`. With `tp=N`
the weight's vocabulary axis is sharded over N simulated devices (the decoder's "vocab" rule).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from dflop_jax.host_devices import simulate_cpu_devices

GIB = 1024**3


def _programs(args):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from models.loss import chunked_cross_entropy_sum, cross_entropy_sum

    dt = jnp.dtype(args.dtype)

    def head(w):
        def project(x):
            out = jnp.einsum("bsd,dv->bsv", x, w.astype(dt))
            return jax.lax.with_sharding_constraint(out, P(None, None, "model"))

        return project

    def full(h, w, t, m):
        return cross_entropy_sum(head(w)(h), t, m)[0]

    def chunked(c):
        return lambda h, w, t, m: chunked_cross_entropy_sum(h, head(w), t, m, chunk=c)[0]

    return [("full logits", full)] + [(f"chunked, chunk={c}", chunked(c)) for c in args.chunks]


def _temp_bytes(fn, mesh, args) -> tuple[int, int]:
    """(temp bytes, argument + output bytes) per device of value_and_grad(fn) w.r.t. (h, w)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def spec(shape, dtype, *axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

    b, s, d, v = args.batch, args.seq, args.hidden, args.vocab
    h = spec((b, s, d), jnp.dtype(args.dtype))
    w = spec((d, v), jnp.float32, None, "model")
    t, m = spec((b, s), jnp.int32), spec((b, s), jnp.float32)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        mem = step.lower(h, w, t, m).compile().memory_analysis()
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes + mem.output_size_in_bytes


COMMAND = command(
    "loss",
    __doc__.split("\n")[0],
    "python -m dflop_jax.bench loss seq=256 hidden=64 vocab=1024 chunks=128",
)


@dataclasses.dataclass(frozen=True)
class LossBenchConfig:
    """The loss's shapes and sharding.

    Attributes:
      batch: rows per batch.
      seq: tokens per row.
      hidden: the hidden size.
      vocab: the vocabulary size.
      chunks: chunk sizes of the chunked cross-entropy (one row each).
      tp: simulated devices the head weight's vocabulary axis is sharded over (divides vocab).
      dtype: compute dtype of the hidden states, "bfloat16" or "float32".
    """

    batch: int = 1
    seq: int = 8192
    hidden: int = 1024
    vocab: int = 152064
    chunks: tuple[int, ...] = (512, 1024, 2048)
    tp: int = 1
    dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def __post_init__(self):
        for key in ("batch", "seq", "hidden", "vocab"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        require(all(c >= 1 for c in self.chunks), "chunks", list(self.chunks), "must be >= 1")
        require(self.tp >= 1 and self.vocab % self.tp == 0, "tp", self.tp,
                f"must be >= 1 and divide vocab={self.vocab}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, LossBenchConfig, argv)
    simulate_cpu_devices(max(cfg.tp, 1))  # before jax starts its backend
    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices("cpu")[: cfg.tp]), ("model",))
    logits_gib = cfg.batch * cfg.seq * cfg.vocab / cfg.tp * 4 / GIB
    print(
        f"B={cfg.batch} S={cfg.seq} D={cfg.hidden} V={cfg.vocab} tp={cfg.tp} "
        f"hidden {cfg.dtype}, head float32; [B,S,V/tp] float32 logits = {logits_gib:.2f} GiB"
    )
    print(f"{'loss':<22} {'temp GiB/device':>16} {'args+out GiB':>13}")
    for name, fn in _programs(cfg):
        temp, io = _temp_bytes(fn, mesh, cfg)
        print(f"{name:<22} {temp / GIB:>16.3f} {io / GIB:>13.3f}")
    return 0
