"""ZeRO-1 and one data-parallel reduction per step (programs/stage_jits.py, runtime/train_state.py).

Asserted on the compiled HLO text: a dp=2 stage's per-microbatch backward moves no gradient between
data replicas (no all-reduce / reduce-scatter at all on an inner stage; only the two loss scalars on
the last), and the step's reduction program holds the data-parallel reduction. Values: the ZeRO-1
update equals the replicated (pre-ZeRO) update to float32 round-off over several steps.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_fixtures import GROUPS, replica_groups
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models_fixtures import tiny_decoder_config
from pipeline_reference import assert_trees_close

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.profiling.programs import stage_program
from dflop_jax.programs.accumulator import accumulator_structs
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import model_config_for_arch
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.programs.stage_fns import StageFns
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.programs.transfer import put_host
from dflop_jax.programs.zero1_layout import zero1_layout, zero1_sharding
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates

LAYOUT = Layout(
    (),
    (
        StageSpec("llm", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("llm", 1, 1, tp=2, dp=2),
        StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True),
    ),
)


def _two_stage_decoder(dp: int) -> Layout:
    return Layout(
        (),
        (
            StageSpec("llm", 0, 1, tp=1, dp=dp, has_embedding=True),
            StageSpec("llm", 1, 2, tp=1, dp=dp, has_head=True),
        ),
    )


# dp 3 against the tiny decoder's widths (vocab 61, hidden 32, heads 4 x 8, kv 2 x 8; only the
# MLP's 48 divides by 3): most leaves have no axis divisible by dp, so ZeRO-1 pads them.
LAYOUT_DP3, LAYOUT_DP2 = _two_stage_decoder(3), _two_stage_decoder(2)

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=0.5)
COLLECTIVE = re.compile(
    rf"= (\(.*?\)|\S+) (?:all-reduce|reduce-scatter)(?:-start)?\(.*?replica_groups=({GROUPS}),"
)


def _data_collectives(compiled, tp: int) -> list[str]:
    """Result shapes of the all-reduces / reduce-scatters whose groups span data replicas (devices
    of a (dp, tp) mesh in row-major order: a group with members in two rows crosses "data")."""
    out = []
    for shape, groups in COLLECTIVE.findall(compiled.as_text()):
        if any(len({d // tp for d in g}) > 1 for g in replica_groups(groups)):
            out.append(shape)
    return out


def _mesh22() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def test_zero1_sharding_adds_data_on_largest_divisible_axis():
    mesh = _mesh22()
    spec = lambda shape, s: zero1_sharding(shape, NamedSharding(mesh, s)).spec  # noqa: E731
    assert spec((8, 6), P(None, "model")) == P("data", "model")  # 6 % (2 * 2) != 0
    assert spec((4, 12), P(None, "model")) == P(None, ("model", "data"))  # on top of tp
    assert spec((6,), P()) == P("data")


def test_zero1_layout_pads_the_largest_axis_when_nothing_divides():
    mesh = _mesh22()
    lay = lambda shape, s: zero1_layout(shape, NamedSharding(mesh, s))  # noqa: E731
    three_five = lay((3, 5), P())
    assert (three_five.padded, three_five.sharding.spec) == ((3, 6), P(None, "data"))
    five_six = lay((5, 6), P(None, "model"))  # 6 % (2 * 2) != 0, 5 % 2 != 0
    assert (five_six.padded, five_six.sharding.spec) == ((5, 8), P(None, ("model", "data")))
    assert lay((8, 6), P(None, "model")).padded == (8, 6)  # an axis divides: no padding
    assert lay((), P()).sharding.spec == P()  # a scalar (a step count) stays replicated


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_microbatch_backward_has_no_data_reduction(stage):
    """dp 2 stages (tp 1, tp 2, the last): no parameter gradient crosses data replicas in a
    microbatch's backward; on the last stage only the scalar loss and token count are summed over
    "data"; on the first (MLLM) one nothing: each row reads only its own block of features (tiles
    packed by row), so dL/d(features) stays within the row's tp devices."""
    cfg = model_config_for_arch(
        "tiny", "float32"
    )  # an MLLM: the profiler's stage builder needs one
    mesh, spec = stage_meshes(LAYOUT)[stage], LAYOUT.stages[stage]
    prog = stage_program(cfg, spec, mesh, 32, jnp.float32)
    with jax.set_mesh(mesh):
        compiled = prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()
    across = _data_collectives(compiled, spec.tp)
    if spec.has_embedding:  # the image features arrive split over "data" and stay per row
        assert prog.x_abs.sharding.spec == P(("data", "model"))
        assert across == [], across
    elif spec.has_head:
        assert across == ["(f32[], f32[])"], across
    else:
        assert across == [], across
    if stage == 1:  # the tp collectives are still there (the parser sees them)
        assert COLLECTIVE.findall(compiled.as_text())


def _stages_and_grads(zero1: bool, layout: Layout = LAYOUT, seed: int = 0):
    cfg = tiny_decoder_config(num_layers=3, dtype="float32")
    stages = build_stages(cfg, layout, stage_meshes(layout), seed, compute_dtype=jnp.float32)
    opts = [StageOptimizer(s, OPT.build(), zero1) for s in stages]
    return stages, opts


def _placed(stage, leaves: list) -> list:
    """The stage's accumulator buffers holding `leaves` (host arrays, each (dp, *param.shape))."""
    acc = stage.accumulator
    bufs = acc.pack(acc.tree.unflatten(leaves))
    return [put_host(b, s.sharding) for b, s in zip(bufs, acc.structs)]


def _random_accumulators(stages, rng) -> list:
    """Per-replica accumulators with different values per replica (their sum is the gradient)."""
    out = []
    for s in stages:
        dp = s.mesh.shape["data"]
        shapes = [(dp, *slot.shape) for slot in s.accumulator.slots]
        out.append(_placed(s, [rng.normal(size=a).astype(np.float32) for a in shapes]))
    return out


def test_step_reduction_is_the_one_data_collective():
    """The step's one data-parallel reduction: the reduce program sums the accumulator over "data"
    (on XLA:CPU an all-reduce then a slice; reduce-scatter where the backend has it), one collective
    per gradient leaf at most (XLA combines leaves), each over the data replicas."""
    _, opts = _stages_and_grads(True)
    opt = opts[1]  # dp 2 x tp 2
    with jax.set_mesh(opt.stage.mesh):
        compiled = opt._reduce.lower(accumulator_structs(opt.stage.params)).compile()
    across = _data_collectives(compiled, 2)
    assert across, "the reduce program must hold the data-parallel reduction"
    assert len(across) == len(COLLECTIVE.findall(compiled.as_text()))
    assert len(across) <= len(jax.tree.leaves(opt.stage.params))


def test_zero1_update_equals_replicated_update():
    """Three steps of AdamW with clipping from the same accumulators: ZeRO-1 state sharded over
    "data" vs the replicated layout; params agree to float32 round-off, state is really sharded."""
    runs = {}
    for zero1 in (False, True):
        stages, opts = _stages_and_grads(zero1)
        rng = np.random.default_rng(1)
        stats = [apply_updates(opts, _random_accumulators(stages, rng), 0.5) for _ in range(3)]
        norms = [float(np.asarray(s[-1])[1]) for s in stats]  # STATS: loss, grad_norm, ...
        runs[zero1] = ([jax.device_get(s.params) for s in stages], norms, opts)
    (p_rep, n_rep, _), (p_z, n_z, opts_z) = runs[False], runs[True]
    np.testing.assert_allclose(n_z, n_rep, rtol=1e-6)
    for a, b in zip(p_z, p_rep):
        assert_trees_close(a, b)
    sharded = [
        leaf
        for opt in opts_z
        for leaf in jax.tree.leaves(opt.state)
        if leaf.ndim and "data" in str(leaf.sharding.spec)
    ]
    assert sharded, "ZeRO-1 must shard the AdamW moments over data"
    leaf = sharded[0]
    assert leaf.addressable_shards[0].data.size * 2 <= leaf.size


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("split", [False, True], ids=["replicated", "split"])
def test_replicated_stage_input_gets_every_replicas_gradient(tp, split):
    """An x the functions take replicated over "data" is read by every replica's rows: its dL/dx is
    the sum of the replicas' shares, as on one device; also where x arrives split over all the
    stage's devices (the MLLM's image features: x_spec P(("data", "model"))) and is gathered in the
    program, its dL/dx going back split."""
    mesh = Mesh(np.array(jax.devices()[: 2 * tp]).reshape(2, tp), ("data", "model"))
    x_spec, inner = (P(("data", "model")), P()) if split else (P(), None)
    fns = StageFns(
        forward=lambda p, x, s: jnp.tanh(x[s["rows"]] @ p["w"]),
        side_keys=("rows",),
        x_spec=x_spec,
        x_compute_spec=inner,
    )
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    rows, gy = np.array([3, 0, 3, 1], np.int32), rng.normal(size=(4, 8)).astype(np.float32)
    params = {"w": put_host(w, NamedSharding(mesh, P(None, "model")))}
    stage = StageProgram(mesh, fns, params, compute_dtype=jnp.float32)
    gx, acc = stage.backward(
        put_host(x, NamedSharding(mesh, x_spec)),
        stage.put_side({"rows": rows}),
        put_host(gy, NamedSharding(mesh, P("data"))),
        stage.zero_grads(),
    )
    _, vjp = jax.vjp(lambda w_, x_: jnp.tanh(x_[rows] @ w_), w, x)
    want_gw, want_gx = vjp(gy)
    np.testing.assert_allclose(np.asarray(gx), want_gx, rtol=1e-5, atol=1e-6)
    assert gx.sharding.spec == x_spec
    np.testing.assert_allclose(np.asarray(acc["w"]).sum(0), want_gw, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(acc["w"])[0] - want_gw).max() > 1e-3  # per replica, not reduced


def _gradient_accumulators(stages, step: int) -> list:
    """Per-replica accumulators whose sum over replicas is a gradient that depends on the step and
    the params' shapes only (not on dp): runs at different dp see the same reduced gradients."""
    out = []
    for i, s in enumerate(stages):
        dp = s.mesh.shape["data"]
        rng = np.random.default_rng(1000 * step + i)
        accs = []
        for slot in s.accumulator.slots:
            g = rng.normal(size=slot.shape).astype(np.float32)
            share = np.stack([g * (r + 1) for r in range(dp)])
            share /= sum(r + 1 for r in range(dp))
            accs.append(share.astype(np.float32))
        out.append(_placed(s, accs))
    return out


def _moments(opt) -> list:
    """(Zero1Leaf, live mu shard array) for each param leaf of a plain-AdamW stage optimizer."""
    mu = opt.shards[0].mu
    return list(zip(jax.tree.leaves(opt.layout), jax.tree.leaves(mu)))


def test_zero1_pads_leaves_with_no_axis_divisible_by_dp():
    """dp 3 over non-divisible widths: two AdamW steps with clipping give the params of the
    replicated (unsharded) optimizer to float32 round-off; every moment leaf but the step count is
    really 1/3 per device (padded where no axis divides) and its padding stays zero."""
    runs = {}
    for zero1 in (False, True):
        stages, opts = _stages_and_grads(zero1, LAYOUT_DP3)
        stats = [apply_updates(opts, _gradient_accumulators(stages, k), 0.5) for k in range(2)]
        norms = [float(np.asarray(s[-1])[1]) for s in stats]
        runs[zero1] = ([jax.device_get(s.params) for s in stages], norms, opts)
    (p_rep, n_rep, _), (p_z, n_z, opts_z) = runs[False], runs[True]
    assert n_rep[0] > 0.5  # clipping is active
    np.testing.assert_allclose(n_z, n_rep, rtol=1e-6)
    for a, b in zip(p_z, p_rep):
        assert_trees_close(a, b)
    padded = 0
    for opt in opts_z:
        for lay, mu in _moments(opt):
            axis = next(i for i, (n, p) in enumerate(zip(lay.shape, lay.padded)) if n != p) \
                if lay.is_padded else None  # fmt: skip
            want = list(lay.padded)
            if axis is not None:
                padded += 1
                want[axis] //= 3
                host = np.asarray(mu)
                tail = np.take(host, range(lay.shape[axis], lay.padded[axis]), axis=axis)
                assert not tail.any(), "the padding of the moments must stay zero"
                assert np.abs(host).max() > 0
                assert mu.addressable_shards[0].data.shape == tuple(want)
            assert mu.addressable_shards[0].data.size * 3 == mu.size
    assert padded >= 10  # the attention, norm and embedding leaves of the tiny decoder


def test_checkpoint_of_padded_zero1_state_resumes_at_another_dp(tmp_path):
    """A run saved at dp 3 (padded ZeRO-1 state) resumes at dp 2 and one saved at dp 2 resumes at
    dp 3: two steps, save, restore into the other layout, two more steps == four steps straight."""
    from dflop_jax.runtime.checkpoint import Checkpointer

    def train(stages, opts, steps):
        for k in steps:
            apply_updates(opts, _gradient_accumulators(stages, k), OPT.clip_norm)

    def save(layout, stages, opts, name):
        ckpt = Checkpointer(tmp_path / name, keep=1)
        ckpt.save(2, list(layout.stages), [s.params for s in stages], [o.state for o in opts], {})
        ckpt.close()
        return [jax.device_get(o.state) for o in opts]

    def restore(layout, stages, opts, name):
        ckpt = Checkpointer(tmp_path / name, keep=1)
        trees = [s.params for s in stages], [o.state for o in opts]
        params, states, _ = ckpt.restore(list(layout.stages), *trees)
        ckpt.close()
        for s, o, p, st in zip(stages, opts, params, states):
            s.params, o.state = p, st

    def check(stages, opts, saved, straight):
        for o, want in zip(opts, saved):  # the unpadded state, whatever the layout
            jax.tree.map(np.testing.assert_array_equal, jax.device_get(o.state), want)
        train(stages, opts, range(2, 4))
        for s, ref in zip(stages, straight):
            assert_trees_close(jax.device_get(s.params), ref)

    stages3, opts3 = _stages_and_grads(True, LAYOUT_DP3)
    train(stages3, opts3, range(2))
    saved3 = save(LAYOUT_DP3, stages3, opts3, "dp3")
    train(stages3, opts3, range(2, 4))
    straight = [jax.device_get(s.params) for s in stages3]
    stages2, opts2 = _stages_and_grads(True, LAYOUT_DP2, seed=7)
    restore(LAYOUT_DP2, stages2, opts2, "dp3")
    saved2 = save(LAYOUT_DP2, stages2, opts2, "dp2")  # the dp 3 step-2 state, written at dp 2
    check(stages2, opts2, saved3, straight)
    restore(LAYOUT_DP3, stages3, opts3, "dp2")  # back into the padded layout
    check(stages3, opts3, saved2, straight)


def test_update_programs_of_a_padded_stage_compile_ahead_and_match_reduce():
    """The optimizer's programs lower from abstract inputs before step 1 (`StageOptimizer.lower`) on
    a stage whose ZeRO-1 layout pads leaves (dp 3): the gradient structs are the padded layout's, as
    `reduce` really returns them."""
    stages, opts = _stages_and_grads(True, LAYOUT_DP3)
    for stage, opt in zip(stages, opts):
        assert any(lay.is_padded for lay in jax.tree.leaves(opt.layout))
        for lowering in opt.lower():
            lowering.lowered.compile()
        acc = _gradient_accumulators([stage], 0)[0]
        reduced = opt.reduce(acc)
        structs = opt.grad_structs()
        got = jax.tree.map(lambda x: (x.shape, x.sharding), reduced)
        want = jax.tree.map(lambda s: (s.shape, s.sharding), structs)
        assert got == want
