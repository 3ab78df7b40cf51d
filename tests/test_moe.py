"""models/llm.py's mixture of experts: the load-balancing loss and expert parallelism."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.sharding import on_mesh, row_sharding, section_mesh, variable_shardings
from models import DecoderLM, LLMConfig, apply_with_losses
from models.llm import balance_loss_sum

CFG = LLMConfig(vocab=64, width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp=64, experts=4, experts_per_token=2,
                expert_mlp=16, router_aux_loss=0.01)


def inputs(rows=4, length=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, CFG.vocab, (rows, length)), jnp.int32)
    lengths = rng.integers(3, length + 1, rows)
    valid = jnp.asarray(np.arange(length)[None] < lengths[:, None])
    positions = jnp.where(valid, jnp.arange(length)[None], 0)
    return ids, positions, valid


def test_balance_loss_is_one_per_token_under_a_uniform_router_and_adds_over_rows():
    experts, k = 4, 2
    probs = jnp.full((2, 8, experts), 1 / experts)
    chosen = jnp.zeros((2, 8, experts)).at[:, :, :k].set(1.0)  # each token picks 2 of 4
    chosen = chosen.at[:, ::2].set(jnp.roll(chosen[:, ::2], 2, axis=-1))  # half pick the other two: f = 1/4 each
    valid = jnp.asarray(np.arange(8)[None] < np.array([[8], [5]]))
    assert float(balance_loss_sum(probs, chosen, valid, k)) == pytest.approx(8 + 5)  # valid tokens x 1
    skewed = jax.nn.softmax(jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, experts))) * 3)
    whole = balance_loss_sum(skewed, chosen, valid, k)
    halves = balance_loss_sum(skewed[:1], chosen[:1], valid[:1], k) + balance_loss_sum(skewed[1:], chosen[1:], valid[1:], k)
    assert float(whole) == pytest.approx(float(halves), rel=1e-6) and float(whole) > 8 + 5 - 1e-3


def test_each_layer_sows_its_weighted_balance_loss_and_it_trains_the_router():
    model = DecoderLM(CFG)
    ids, positions, valid = inputs()
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, positions, valid)["params"])
    aux_of = jax.jit(lambda m, p: apply_with_losses(m, {"params": p}, ids, positions, valid)[1], static_argnums=0)
    aux = aux_of(model, params)
    tokens = float(jnp.sum(valid))
    # each of the 2 layers adds weight x (valid tokens x a balance term >= 1)
    assert 2 * CFG.router_aux_loss * tokens * 0.99 <= float(aux) <= 2 * CFG.router_aux_loss * tokens * 4
    grads = jax.jit(jax.grad(lambda p: aux_of(model, p)))(params)
    assert float(jnp.abs(grads["block_0"]["moe"]["router"]).max()) > 0
    silent = DecoderLM(LLMConfig(**{**CFG.__dict__, "router_aux_loss": 0.0}))
    assert float(aux_of(silent, params)) == 0.0


@pytest.mark.parametrize("axes", [dict(expert=4), dict(expert=2, context=2), dict(data=2, context=2)])
def test_expert_and_context_parallel_layers_equal_one_device_and_really_shard(axes):
    """The same forward, loss and gradients on 4 devices with experts and/or positions sharded;
    the compiled program gathers over the split axes (keys and values, or tokens for experts)."""
    model = DecoderLM(CFG)
    ids, positions, valid = inputs()
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, positions, valid))
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, positions, valid)["params"])

    def loss(p, ids, positions, valid):
        logits, aux = apply_with_losses(model, {"params": p}, ids, positions, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * valid) + aux

    ref_loss, ref_grads = jax.value_and_grad(loss)(params, ids, positions, valid)
    sp = SectionPlan((0, 1, 2, 3), mesh_shape(**axes), 1)
    mesh = section_mesh(sp)
    shard = variable_shardings(boxed, mesh, "default")["params"]
    rows = row_sharding(mesh)
    step = jax.jit(jax.value_and_grad(loss), in_shardings=(shard, rows, rows, rows))
    with on_mesh(mesh, "default"):
        placed = jax.device_put(params, shard)
        got_loss, got_grads = step(placed, ids, positions, valid)
        hlo = step.lower(placed, ids, positions, valid).compile().as_text()
    assert float(got_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    assert "all-gather" in hlo or "all-to-all" in hlo
    gate = got_grads["block_0"]["moe"]["gate"]
    assert gate.addressable_shards[0].data.shape[0] == CFG.experts // axes.get("expert", 1)


def test_ragged_dispatch_equals_the_dense_one():
    """`moe_dispatch: ragged` (sorted tokens, grouped matmuls, only the chosen experts' FLOPs)
    gives the dense dispatch's outputs, balance loss and gradients."""
    import dataclasses

    ids, positions, valid = inputs(seed=1)
    dense, ragged = DecoderLM(CFG), DecoderLM(dataclasses.replace(CFG, moe_dispatch="ragged"))
    params = nn.meta.unbox(dense.init(jax.random.key(1), ids, positions, valid)["params"])

    def loss(model, p):
        logits, aux = apply_with_losses(model, {"params": p}, ids, positions, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * valid) + aux

    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(m, params)
                          for m in (dense, ragged))
    assert float(l1) == pytest.approx(float(l2), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)
    program = str(jax.make_jaxpr(lambda p: loss(ragged, p))(params))
    assert "ragged_dot" in program and "ragged_dot" not in str(jax.make_jaxpr(lambda p: loss(dense, p))(params))
