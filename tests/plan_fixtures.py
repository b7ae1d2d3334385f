"""A plan of the tiny arch (analytic costs on CPU) for the tests that check, save or train from one."""

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, layout_memory
from dflop_jax.planner import Plan
from dflop_jax.planner.scoring import in_flight

TINY_PLAN_LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (StageSpec("llm", 0, 4, tp=2, dp=1, has_embedding=True, has_head=True),),
)
TINY_PLAN_BUCKETS = BucketSet((2, 3), (64, 128))
TINY_PLAN_MAX_M = 5


def tiny_analytic_plan(layout=TINY_PLAN_LAYOUT, scale=1.0) -> Plan:
    """An analytic plan of the tiny arch on 8 CPU devices: `layout` at TINY_PLAN_BUCKETS, 4 to
    TINY_PLAN_MAX_M microbatches of a global batch of 8, 1F1B; each stage's predicted memory the
    analytic model's times `scale`."""
    arch, cpu = get_arch("tiny"), get_device("cpu")
    counts = in_flight(layout.num_stages, TINY_PLAN_MAX_M, "1f1b")
    mems = layout_memory(AnalyticCostProvider(arch, cpu), layout, TINY_PLAN_BUCKETS, counts)
    return Plan("tiny", "cpu", 8, "analytic:tiny@cpu", "dflop", layout, TINY_PLAN_BUCKETS, 4,
                TINY_PLAN_MAX_M, 8, "1f1b", 1.0, 1.0, 0.0, tuple(scale * m.total() for m in mems),
                2**31, 2**31, search={"remat": None})  # fmt: skip
