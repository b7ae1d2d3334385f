"""`models.layers.run_layers`: a stage's layers (as one scan over their stacked weights under remat)
equal the plain Python loop (value and gradients, every remat policy); layers of different structure,
or no remat, run unrolled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers import run_layers


class Block(nnx.Module):
    def __init__(self, d: int, bias: bool, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (d, d)) / d**0.5)
        if bias:
            self.b = nnx.Param(jnp.ones((d,)))
        self.bias = bias

    def __call__(self, h, scale):
        y = jnp.tanh(h @ self.w[...]) * scale
        return h + (y + self.b[...] if self.bias else y)


def _loss_and_grads(layers, run):
    graphdef, state = nnx.split(nnx.List(layers))
    x = jnp.linspace(-1.0, 1.0, 4 * 8).reshape(4, 8)

    def loss(state):
        return jnp.sum(run(nnx.merge(graphdef, state), x) ** 2)

    return jax.value_and_grad(loss)(state)


def _loop(layers, x):
    for layer in layers:
        x = layer(x, 0.5)
    return x


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
@pytest.mark.parametrize("mixed", [False, True])
def test_run_layers_equals_the_python_loop(remat, mixed):
    rngs = nnx.Rngs(0)
    layers = [Block(8, mixed and i == 1, rngs) for i in range(3)]
    (l0, g0) = _loss_and_grads(layers, _loop)
    (l1, g1) = _loss_and_grads(layers, lambda ls, x: run_layers(ls, x, 0.5, remat=remat))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("mixed", [False, True])
def test_remat_of_same_structure_is_one_scan(mixed, remat):
    rngs = nnx.Rngs(0)
    layers = nnx.List([Block(8, mixed and i == 1, rngs) for i in range(3)])
    graphdef, state = nnx.split(layers)
    jaxpr = jax.make_jaxpr(lambda s, x: run_layers(nnx.merge(graphdef, s), x, 0.5, remat=remat))(
        state, jnp.ones((4, 8))
    )
    assert ("scan" in str(jaxpr)) is (not mixed and remat != "none")
