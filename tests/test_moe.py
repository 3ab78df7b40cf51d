"""models/llm.py's mixture of experts: the load-balancing loss and expert parallelism."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maestro_jax.models import DecoderLM, LLMConfig, apply_with_losses
from maestro_jax.models.llm import MoE, balance_loss_sum

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.runtime.sharding import on_mesh, row_sharding, section_mesh, variable_shardings

CFG = LLMConfig(
    vocab=64,
    width=32,
    depth=2,
    heads=4,
    kv_heads=2,
    head_dim=8,
    mlp=64,
    experts=4,
    experts_per_token=2,
    expert_mlp=16,
    router_aux_loss=0.01,
)


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
    halves = balance_loss_sum(skewed[:1], chosen[:1], valid[:1], k) + balance_loss_sum(
        skewed[1:], chosen[1:], valid[1:], k
    )
    assert float(whole) == pytest.approx(float(halves), rel=1e-6) and float(whole) > 8 + 5 - 1e-3


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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

    (l1, g1), (l2, g2) = (
        jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(m, params) for m in (dense, ragged)
    )
    assert float(l1) == pytest.approx(float(l2), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)
    program = str(jax.make_jaxpr(lambda p: loss(ragged, p))(params))
    assert "ragged_dot" in program and "ragged_dot" not in str(jax.make_jaxpr(lambda p: loss(dense, p))(params))


def section(axes: dict) -> jax.sharding.Mesh:
    """The section mesh over the first devices with these axis sizes (the rest 1)."""
    return section_mesh(SectionPlan(tuple(range(int(np.prod(list(axes.values()))))), mesh_shape(**axes), 1))


def l2_rel(got, ref) -> float:
    """The largest L2-relative difference over the leaves (the `maestro-jax verify` measure)."""
    return max(
        float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
    )


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["sparse", "grouped"])
@pytest.mark.parametrize("axes", [None, {"expert": 2, "data": 2}, {"expert": 2, "tensor": 2}])
def test_sparse_dispatch_equals_the_dense_one_and_is_expert_parallel(axes, dispatch, monkeypatch):
    """`moe_dispatch: sparse` gives the dense dispatch's loss (balance loss included) and
    gradients; under an `expert` axis it is a shard_map exchanging tokens with all-to-alls, the
    expert weights (and their gradients) sharded by expert; over `tensor` each device holds a
    slice of the experts' hidden width. Without a mesh it is the local computation.

    `grouped` is the same dispatch with each device's experts through tokamax's grouped GEMM:
    on the CPU its reference ("xla") implementation stands in for the Mosaic GPU kernel, so the
    sizes, the expert order and the three products' wiring are checked wherever tokamax installs
    (Python 3.12 with jax >= 0.11.1, CI's newer interpreter)."""
    import dataclasses

    from maestro_jax.models import llm

    if dispatch == "grouped":
        pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 and jax >= 0.11.1 (the gpu extra)")
        monkeypatch.setattr(llm, "GROUPED_GEMM_IMPLEMENTATION", "xla")
    ids, positions, valid = inputs(seed=2)
    dense, sparse = DecoderLM(CFG), DecoderLM(dataclasses.replace(CFG, moe_dispatch=dispatch))
    boxed = jax.eval_shape(lambda: dense.init(jax.random.key(2), ids, positions, valid))
    params = nn.meta.unbox(dense.init(jax.random.key(2), ids, positions, valid)["params"])

    def loss(model, p, ids, positions, valid):
        logits, aux = apply_with_losses(model, {"params": p}, ids, positions, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * valid) + aux

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
        dense, params, ids, positions, valid
    )
    step = jax.value_and_grad(lambda p, *a: loss(sparse, p, *a))
    if axes is None:
        got_loss, got_grads = jax.jit(step)(params, ids, positions, valid)
        assert "all_to_all" not in str(jax.make_jaxpr(step)(params, ids, positions, valid))
    else:
        mesh = section(axes)
        shard, rows = variable_shardings(boxed, mesh, "default")["params"], row_sharding(mesh)
        with on_mesh(mesh, "default"):
            placed = jax.device_put(params, shard)
            got_loss, got_grads = jax.jit(step, in_shardings=(shard, rows, rows, rows))(placed, ids, positions, valid)
            program = str(jax.make_jaxpr(step)(placed, ids, positions, valid))
        assert "shard_map" in program and "all_to_all" in program
        gate = got_grads["block_0"]["moe"]["gate"].addressable_shards[0].data
        assert gate.shape == (CFG.experts // axes["expert"], CFG.width, CFG.expert_mlp // axes.get("tensor", 1))
    assert float(got_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert l2_rel(got_grads, ref_grads) < 1e-5


def moe_flops(dispatch: str, mesh=None, experts=8, k=2, width=64, hidden=64, shape=(4, 512)) -> float:
    """XLA's FLOPs (per device under `mesh`) of one MoE layer, router included, on `shape` tokens."""
    c = LLMConfig(
        vocab=8,
        width=width,
        depth=1,
        heads=1,
        kv_heads=1,
        head_dim=8,
        mlp=8,
        experts=experts,
        experts_per_token=k,
        expert_mlp=hidden,
        moe_dispatch=dispatch,
    )
    h, valid = jnp.zeros((*shape, width)), jnp.ones(shape, bool)
    boxed = jax.eval_shape(lambda: MoE(c).init(jax.random.key(0), h, valid))
    params = nn.meta.unbox(MoE(c).init(jax.random.key(0), h, valid))

    def layer(p, h):
        return MoE(c).apply(p, h, valid)

    if mesh is None:
        return jax.jit(layer).lower(params, h).compile().cost_analysis()["flops"]
    with on_mesh(mesh, "default"):
        step = jax.jit(layer, in_shardings=(variable_shardings(boxed, mesh, "default"), row_sharding(mesh)))
        return step.lower(params, h).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_sparse_dispatch_runs_the_chosen_experts_flops():
    """XLA counts about experts_per_token / experts of the dense dispatch's FLOPs for the sparse
    one. Above that by at most the tile padding (< experts x (tile - 1) rows, tile = expert_mlp:
    12% of the 2 x 2048 routed rows here) and 5% for the router, top-k, sorts and scatters XLA
    also counts. Under an `expert` axis of 2 the receive buffers are sized for the worst case
    (every token of the group to one device), so each device runs experts_per_token x 2 /
    experts of the dense FLOPs (its 4 experts on all the group's tokens) plus the same padding."""
    experts, k, hidden, tokens = 8, 2, 64, 4 * 512
    dense, sparse = moe_flops("dense"), moe_flops("sparse")
    padding = 1 + experts * (hidden - 1) / (tokens * k)
    assert k / experts <= sparse / dense <= k / experts * padding * 1.05
    mesh = section({"expert": 2})
    dense, sparse = moe_flops("dense", mesh), moe_flops("sparse", mesh)
    padding = 1 + experts // 2 * (hidden - 1) / (tokens * k)
    assert k * 2 / experts <= sparse / dense <= k * 2 / experts * padding * 1.05


@pytest.mark.parametrize("skew", [(8.0, 0.0), (8.0, 6.0)])
@pytest.mark.slow
def test_sparse_dispatch_is_dropless_under_skewed_routing(skew):
    """A router biased so every token picks expert 0 (and its second expert at random), or
    experts 0 and 1, which live on the same device: that device receives every pair of the
    group, the worst case its buffers are sized for, and nothing is dropped."""
    import dataclasses

    mesh = section({"expert": 2, "data": 2})
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((4, 16, CFG.width)) + 1.0, jnp.float32)  # features mostly positive
    valid, probe = jnp.ones((4, 16), bool), jnp.asarray(rng.standard_normal((4, 16, CFG.width)), jnp.float32)
    dense, sparse = MoE(CFG), MoE(dataclasses.replace(CFG, moe_dispatch="sparse"))
    boxed = jax.eval_shape(lambda: dense.init(jax.random.key(3), h, valid))
    params = nn.meta.unbox(dense.init(jax.random.key(3), h, valid)["params"])
    router = params["router"].at[:, 0].add(skew[0] / CFG.width).at[:, 1].add(skew[1] / CFG.width)
    params = {"params": {**params, "router": router}}
    picked = jax.lax.top_k(h @ router, CFG.experts_per_token)[1]
    assert bool(jnp.all(picked[..., 0] == 0)) and bool(jnp.all(picked[..., 1] == 1)) == (skew[1] > 0)

    def loss(model, p, h):
        out, aux = apply_with_losses(model, p, h, valid)
        return jnp.sum(out * probe) + aux

    ref_loss, ref_grads = jax.value_and_grad(lambda p, h: loss(dense, p, h), argnums=(0, 1))(params, h)
    shard = {"params": variable_shardings(boxed, mesh, "default")["params"]}
    with on_mesh(mesh, "default"):
        step = jax.jit(
            jax.value_and_grad(lambda p, h: loss(sparse, p, h), argnums=(0, 1)),
            in_shardings=(shard, row_sharding(mesh)),
        )
        got_loss, got_grads = step(jax.device_put(params, shard), h)
    assert float(got_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert l2_rel(got_grads, ref_grads) < 1e-5


def test_auto_dispatch_is_the_fastest_measured_per_backend_and_priced_as_it_runs():
    """`moe_dispatch: auto` resolves where the config is built: `dense` on CPU, `sparse` on an
    NVIDIA GPU (models.llm.AUTO_DISPATCH); the cost model then prices what runs, and prices
    `ragged` as the dense expansion XLA makes of it."""
    import dataclasses

    from maestro_jax.models.llm import moe_dispatch_for

    from maestro_jax.workloads.costs import llm_cost

    assert jax.default_backend() == "cpu" and dataclasses.replace(CFG, moe_dispatch="auto").moe_dispatch == "dense"
    assert moe_dispatch_for("auto", "gpu") == "sparse" and moe_dispatch_for("ragged", "gpu") == "ragged"
    flops = {d: llm_cost(dataclasses.replace(CFG, moe_dispatch=d), head=False).flops for d in ("dense", "ragged")}
    sparse = {d: llm_cost(dataclasses.replace(CFG, moe_dispatch=d), head=False).flops for d in ("sparse", "grouped")}
    assert flops["dense"] == flops["ragged"] > sparse["sparse"] == sparse["grouped"]


def test_the_grouped_dispatch_runs_sparse_where_its_kernel_is_missing_said_once(caplog):
    """`moe_dispatch: grouped` without its kernel here (the CPU) builds the `sparse` dispatch, the
    same one without tokamax's grouped GEMM, and says so in one warning however often the model is
    built; the dispatch asked for elsewhere is untouched."""
    import logging

    from conftest import ROOT

    from maestro_jax import workloads
    from maestro_jax.config import load_config
    from maestro_jax.workloads import model

    moe = ["models.llm.experts=4", "models.llm.experts_per_token=2", "models.llm.expert_mlp=16"]
    cfg = load_config(ROOT / "configs/vlm_tiny.yaml", [*moe, "models.llm.moe_dispatch=grouped"])
    workloads._said_grouped_fallback.cache_clear()  # said once a process: as if none had said it yet
    with caplog.at_level(logging.WARNING, logger="maestro_jax"):
        built = [model(cfg, "llm", "llm") for _ in range(3)]
    assert [m.moe_dispatch for m in built] == ["sparse"] * 3
    said = [r.getMessage() for r in caplog.records if "moe_dispatch" in r.getMessage()]
    assert (
        len(said) == 1 and said[0].startswith("models.llm.moe_dispatch: grouped needs ") and "running sparse" in said[0]
    )
    assert (
        model(
            load_config(ROOT / "configs/vlm_tiny.yaml", [*moe, "models.llm.moe_dispatch=ragged"]), "llm", "llm"
        ).moe_dispatch
        == "ragged"
    )


def test_the_grouped_dispatch_asked_for_strictly_is_refused_in_one_line_where_its_kernel_is_missing(capsys):
    import importlib.util

    from conftest import ROOT
    from maestro_jax.models.llm import grouped_gemm_missing

    from maestro_jax import cli

    assert "capability" in grouped_gemm_missing("cpu", 0.0, (0, 11, 2))
    assert "jax >= 0.11.1" in grouped_gemm_missing("gpu", 9.0, (0, 10, 2))
    assert "compute capability" in grouped_gemm_missing("gpu", 8.0, (0, 11, 2))
    has_tokamax = importlib.util.find_spec("tokamax") is not None
    assert (grouped_gemm_missing("gpu", 9.0, (0, 11, 2)) is None) == has_tokamax
    moe = ["models.llm.experts=4", "models.llm.experts_per_token=2", "models.llm.expert_mlp=16"]
    argv = ["verify", "--config", str(ROOT / "configs/vlm_tiny.yaml"), *moe, "models.llm.moe_dispatch=grouped"]
    assert cli.main([*argv, "models.llm.moe_dispatch_strict=true"]) == 2  # asked for strictly: refused
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: models.llm.moe_dispatch='grouped' with moe_dispatch_strict")
    assert "valid here: auto, dense, ragged, sparse" in err[0]


def test_the_auto_dispatch_says_its_choice_once_a_backend(caplog):
    import logging

    from maestro_jax.models import llm

    llm._log_dispatch.cache_clear()  # once a process: as if nothing had been said yet
    with caplog.at_level(logging.INFO, logger="maestro_jax"):
        chosen = [llm.moe_dispatch_for("auto", p) for p in ("gpu", "gpu", "cpu", "gpu", "cpu")]
        llm.moe_dispatch_for("sparse", "gpu")  # asked for by name: nothing to say
    assert chosen == ["sparse", "sparse", "dense", "sparse", "dense"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moe_dispatch auto")]
    assert said == [
        "moe_dispatch auto on gpu: sparse (models.llm.AUTO_DISPATCH)",
        "moe_dispatch auto on cpu: dense (models.llm.AUTO_DISPATCH)",
    ]


def test_a_qwen2_moe_layer_keeps_its_router_weights_and_adds_its_gated_shared_expert():
    """Qwen2-MoE's block (`moe_renormalize: false`, a `shared_expert_mlp`): the sparse dispatch
    gives the dense one's logits and gradients; the top-k weights are the softmax's own (with them
    renormalised the logits differ), and the shared expert adds to the routed ones (with its output
    projection zero, the routed experts' logits return)."""
    import dataclasses

    qwen2 = dataclasses.replace(CFG, moe_renormalize=False, shared_expert_mlp=24)
    ids, positions, valid = inputs(seed=2)
    dense, sparse = DecoderLM(qwen2), DecoderLM(dataclasses.replace(qwen2, moe_dispatch="sparse"))
    params = nn.meta.unbox(dense.init(jax.random.key(2), ids, positions, valid)["params"])
    assert params["block_0"]["shared_expert_gate"]["kernel"].shape == (32, 1)

    def loss(model, p):
        logits, aux = apply_with_losses(model, {"params": p}, ids, positions, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * valid) + aux, logits

    (l1, z1), g1 = jax.value_and_grad(lambda p: loss(dense, p), has_aux=True)(params)
    (l2, z2), g2 = jax.value_and_grad(lambda p: loss(sparse, p), has_aux=True)(params)
    np.testing.assert_allclose(np.asarray(z1), np.asarray(z2), rtol=1e-4, atol=1e-5)
    assert float(l1) == pytest.approx(float(l2), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)
    renormalised = DecoderLM(dataclasses.replace(qwen2, moe_renormalize=True))
    assert not np.allclose(np.asarray(loss(renormalised, params)[1]), np.asarray(z1), atol=1e-4)
    shut = jax.tree.map(lambda x: x, params)
    for b in ("block_0", "block_1"):
        shut[b]["shared_down"]["kernel"] = jnp.zeros_like(shut[b]["shared_down"]["kernel"])
    routed = DecoderLM(dataclasses.replace(CFG, moe_renormalize=False))
    alone = {b: {k: v for k, v in shut[b].items() if not k.startswith("shared_")} for b in ("block_0", "block_1")}
    np.testing.assert_allclose(
        np.asarray(loss(dense, shut)[1]), np.asarray(loss(routed, {**shut, **alone})[1]), rtol=1e-5, atol=1e-5
    )
