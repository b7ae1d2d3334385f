"""Loss memory: compiled temporaries of loss + gradient, full-logits vs chunked cross-entropy.

    python -m dflop_jax.bench loss [--batch 1 --seq 8192 --hidden 1024 --vocab 152064]
                                   [--chunks 512,1024,2048] [--tp 1] [--dtype bfloat16]

Compiles (on CPU, from abstract shapes: nothing is materialized) value_and_grad w.r.t. the final
hidden states and the head weight of (a) `cross_entropy_sum(h @ W, ...)` (the [B,S,V] logits, upcast
to float32) and (b) `chunked_cross_entropy_sum(h, head, ..., chunk=c)`, and prints each program's
`memory_analysis()` temporaries per device. Hidden states are in `--dtype` (the compute dtype), the
head weight is float32 (master weights) cast inside the head, as in `models.decoder`. With `--tp N`
the weight's vocabulary axis is sharded over N simulated devices (the decoder's "vocab" rule).
"""

from __future__ import annotations

import argparse

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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dflop_jax.bench loss", description=__doc__)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument(
        "--chunks", type=lambda x: [int(c) for c in x.split(",")], default=[512, 1024, 2048]
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    if args.tp < 1 or args.vocab % args.tp:
        p.error(f"--tp {args.tp} must be >= 1 and divide --vocab {args.vocab}")
    simulate_cpu_devices(max(args.tp, 1))  # before jax starts its backend
    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices("cpu")[: args.tp]), ("model",))
    logits_gib = args.batch * args.seq * args.vocab / args.tp * 4 / GIB
    print(
        f"B={args.batch} S={args.seq} D={args.hidden} V={args.vocab} tp={args.tp} "
        f"hidden {args.dtype}, head float32; [B,S,V/tp] float32 logits = {logits_gib:.2f} GiB"
    )
    print(f"{'loss':<22} {'temp GiB/device':>16} {'args+out GiB':>13}")
    for name, fn in _programs(args):
        temp, io = _temp_bytes(fn, mesh, args)
        print(f"{name:<22} {temp / GIB:>16.3f} {io / GIB:>13.3f}")
    return 0
