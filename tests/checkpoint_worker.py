"""One process of a multi-process `Checkpointer` test (no training: stage state from a formula).

    python tests/checkpoint_worker.py <save|check> <layout> <dir> [<processes> <rank> <host:port>]

Every leaf's value is a function of its GLOBAL path (module, kind, global layer), so a check on any
layout knows what each of its shards must hold. `save` writes step 1 of the layout's state; `check`
restores it onto the layout's stages and compares every addressable shard (each process sees only
its own). Non-local stages hold ShapeDtypeStructs, as in the trainer.
"""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes

LAYOUTS = {  # all llm, 4 layers, 8 devices
    # 2 processes x 4: two stages on process 0, one stage on process 1 (first_layer, layers, dp, tp)
    "two_on_p0": ((0, 1, 1, 2), (1, 1, 1, 2), (2, 2, 1, 2)),
    # one stage over all 8 devices (spans both processes)
    "one_wide": ((0, 4, 4, 2),),
    # 1 process: uneven stages
    "uneven": ((0, 3, 2, 2), (3, 1, 2, 1)),
}


def layout(name: str) -> Layout:
    return Layout((), tuple(StageSpec("llm", f, n, tp=tp, dp=dp) for f, n, dp, tp in LAYOUTS[name]))


def value(global_layer: int, kind: str) -> np.ndarray:
    return (
        np.arange(24, dtype=np.float32).reshape(4, 6)
        + 100 * global_layer
        + (0.5 if kind == "opt" else 0)
    )


def stage_state(spec: StageSpec, mesh, kind: str):
    """{"layers": {"<local i>": {"w": (4, 6)}}} (+ "count" in opt); abstract when non-local."""
    sharding = NamedSharding(mesh, P("data", "model"))
    local = any(d.process_index == jax.process_index() for d in mesh.devices.flat)

    def leaf(x, s):
        if not local:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    tree = {"layers": {str(i): {"w": leaf(value(spec.first_layer + i, kind), sharding)}
                       for i in range(spec.num_layers)}}  # fmt: skip
    if kind == "opt":
        tree["count"] = leaf(np.array(7, np.int32), NamedSharding(mesh, P()))
    return tree


def main(mode: str, name: str, directory: str) -> None:
    from dflop_jax.runtime.checkpoint import Checkpointer

    lay = layout(name)
    specs, meshes = list(lay.stages), stage_meshes(lay)
    params = [stage_state(s, m, "params") for s, m in zip(specs, meshes)]
    opts = [stage_state(s, m, "opt") for s, m in zip(specs, meshes)]
    ckpt = Checkpointer(directory, keep=2)
    if mode == "save":
        ckpt.save(1, specs, params, opts, meta={"loader": {"process": jax.process_index()}})
        ckpt.close()
        print("saved", flush=True)
        return
    new_p, new_o, meta = ckpt.restore(specs, params, opts)
    checked = 0
    for spec, p, o in zip(specs, new_p, new_o):
        for kind, tree in (("params", p), ("opt", o)):
            for i, layer in tree["layers"].items():
                if isinstance(layer["w"], jax.Array):
                    want = value(spec.first_layer + int(i), kind)
                    for shard in layer["w"].addressable_shards:
                        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
                        checked += 1
            if kind == "opt" and isinstance(tree["count"], jax.Array):  # stored once per group
                assert int(np.asarray(tree["count"].addressable_shards[0].data)) == 7
    print(f"checked {checked} shards; meta {meta['loader']}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 6:
        jax.config.update("jax_num_cpu_devices", 8 // int(args[3]))
        jax.distributed.initialize(args[5], int(args[3]), int(args[4]))
    else:
        jax.config.update("jax_num_cpu_devices", 8)
    main(*args[:3])
