"""models/layers.py: attention through jax.nn.dot_product_attention against the formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maestro_jax.models.layers import attention, rows_with_keys, segment_mask


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v per head, key/value heads shared by groups of query heads."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,blhd->bhql", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -1e30)
    return jnp.einsum("bhql,blhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_grouped_query_attention_with_packed_segments_and_padding():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 7, 6, 8), (2, 7, 3, 8), (2, 7, 3, 8)))
    mask = segment_mask(jnp.array([[1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]]))
    out, ref = np.asarray(attention(q, k, v, mask)), np.asarray(reference(q, k, v, mask))
    assert np.allclose(out[:, :5], ref[:, :5], atol=1e-5) and np.allclose(out[1], ref[1], atol=1e-5)
    grad = jax.grad(lambda q: attention(q, k, v, mask)[:, :5].sum())(q)
    assert np.allclose(grad, jax.grad(lambda q: reference(q, k, v, mask)[:, :5].sum())(q), atol=1e-5)


def test_a_padding_row_reaches_the_kernel_with_every_key_so_no_implementation_makes_it_nan():
    """cuDNN's fused kernel returns NaN for a query row its mask leaves empty (an H200, jax
    0.11.2: a bfloat16 VLM's gradient norm came out NaN, on both sides of `verify`). `attention`
    hands every implementation the mask with such rows opened to every key: a padding row's output
    is the softmax over its real scores, finite, and the rows with keys are untouched."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    mask = segment_mask(jnp.array([[1, 1, 1, 0, 0, 0], [2, 2, 3, 3, 3, 0]]))
    opened = np.asarray(rows_with_keys(mask))
    has_keys = np.asarray(mask).any(-1)
    assert opened.any(-1).all() and (opened[has_keys] == np.asarray(mask)[has_keys]).all()
    assert opened[~has_keys].all()  # a padding row: every key
    out = np.asarray(attention(q, k, v, mask))
    assert np.allclose(out, reference(q, k, v, jnp.asarray(opened)), atol=1e-5)
    # the padding rows differ from a softmax over a mask of -1e30 (the values' mean): the opened
    # mask, not the raw one, is what attention computes with
    assert not np.allclose(out[0, 3:], reference(q, k, v, mask)[0, 3:], atol=1e-3)


def _stacked(params: dict, depth: int) -> dict:
    """An unrolled tree's `block_i` layers stacked into a scanned tree's `blocks/layer`."""
    rest = {k: v for k, v in params.items() if not k.startswith("block_")}
    layers = [params[f"block_{i}"] for i in range(depth)]
    return {**rest, "blocks": {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}


@pytest.mark.slow
def test_scanned_layers_compute_what_unrolled_layers_do_and_trace_once():
    """`scan_layers`: the same outputs, sown losses and gradients as the unrolled stack (params
    stacked), and a program whose size does not grow with depth."""
    import dataclasses

    import flax.linen as nn
    from maestro_jax.models import DecoderLM, LLMConfig, VisionEncoder, ViTConfig, apply_with_losses

    cfg = LLMConfig(
        vocab=64,
        width=32,
        depth=3,
        heads=4,
        kv_heads=2,
        head_dim=8,
        mlp=64,
        experts=4,
        experts_per_token=2,
        expert_mlp=16,
        router_aux_loss=0.01,
        remat="dots",
    )
    ids = jnp.arange(20, dtype=jnp.int32).reshape(2, 10) % 64
    pos, valid = jnp.tile(jnp.arange(10), (2, 1)), jnp.arange(10)[None] < jnp.array([[10], [6]])
    flat, scanned = DecoderLM(cfg), DecoderLM(dataclasses.replace(cfg, scan_layers=True))
    params = nn.meta.unbox(flat.init(jax.random.key(0), ids, pos, valid)["params"])
    stacked = _stacked(params, cfg.depth)
    assert jax.tree.structure(stacked) == jax.tree.structure(
        nn.meta.unbox(jax.eval_shape(lambda: scanned.init(jax.random.key(0), ids, pos, valid))["params"])
    )

    def loss(model, p):
        logits, aux = apply_with_losses(model, {"params": p}, ids, pos, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * valid) + aux

    (l1, g1), (l2, g2) = (
        jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(m, p)
        for m, p in ((flat, params), (scanned, stacked))
    )
    assert np.allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(_stacked(g1, cfg.depth)), jax.tree.leaves(g2)):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-6)  # summation order: an embedding row of ~7 sums 40 terms

    def size(depth, scan):
        vit = ViTConfig(patch=2, channels=3, width=16, depth=depth, heads=2, mlp=32, out_width=16, scan_layers=scan)
        x, seg, grid = jnp.zeros((1, 16, 12)), jnp.ones((1, 16), jnp.int32), jnp.zeros((1, 16, 2), jnp.int32)
        return len(str(jax.make_jaxpr(lambda: VisionEncoder(vit).init(jax.random.key(0), x, seg, grid))()))

    assert size(8, True) == size(2, True) and size(8, False) > 2 * size(2, False)


def test_balanced_order_evens_the_causal_work_across_the_context_devices():
    """In `balanced_order` each device's slice of a causal mask has the same number of non-empty
    half-by-half blocks against every device's keys (3 against its own, 2 against each other's),
    which are the blocks `ring_attention` computes; the plain order would give the last device
    all the work."""
    from maestro_jax.models.layers import balanced_order

    length, split = 48, 4
    order = balanced_order(length, split)
    assert sorted(order) == list(range(length)) and balanced_order(length, 5) is None
    half = length // split // 2

    def blocks(positions):
        mask = positions[:, None] >= positions[None, :]
        return [
            [
                sum(
                    mask[d * 2 * half + a * half :][:half, s * 2 * half + c * half :][:, :half].any()
                    for a in range(2)
                    for c in range(2)
                )
                for s in range(split)
            ]
            for d in range(split)
        ]

    balanced = blocks(np.arange(length)[order])
    assert all(sum(row) == 3 + 2 * (split - 1) for row in balanced)
    assert all(row[d] == 3 for d, row in enumerate(balanced))
    plain = [sum(row) for row in blocks(np.arange(length))]
    assert plain[0] < plain[-1] and sum(plain) == sum(map(sum, balanced))


@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(context=4), dict(data=2, context=2), dict(context=2, tensor=2)])
def test_ring_attention_equals_one_device_and_passes_keys_round_the_ring(axes):
    """The LLM under ring attention (balanced order, skipped blocks) on 4 devices gives one
    device's loss and gradients, with padding and GQA; its program moves keys and values with
    collective-permutes, not an all-gather of the whole sequence. With tensor parallelism the
    scores are soft-capped too (Gemma 2's `attn_softcap`, low enough to bend them): the ring caps
    each block's scores as the one-device path caps them all."""
    from maestro_jax.models import LLMConfig

    cap = 0.05 if "tensor" in axes else None
    cfg = LLMConfig(vocab=64, width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp=64, attn_softcap=cap)
    hlo = ring_against_one_device(cfg, axes, length=32, lengths=(32, 20, 9, 1))
    assert "collective-permute" in hlo and "conditional" in hlo


def ring_against_one_device(cfg, axes: dict, length: int, lengths, shift=None) -> str:
    """`cfg`'s decoder on 4 devices of mesh `axes` against one device: the loss and gradients of
    rows of `lengths` valid tokens (padded to `length`) equal; returns the 4-device program's HLO.
    `shift(params)`: the parameters moved off their init first (a bias or sink left at 0 hides)."""
    import flax.linen as nn
    from maestro_jax.models import DecoderLM

    from maestro_jax.core.plan import SectionPlan, mesh_shape
    from maestro_jax.runtime.sharding import on_mesh, row_sharding, section_mesh, variable_shardings

    model = DecoderLM(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab, (len(lengths), length)), jnp.int32)
    valid = jnp.asarray(np.arange(length)[None] < np.array(lengths)[:, None])
    positions = jnp.where(valid, jnp.arange(length)[None], 0)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, positions, valid))
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, positions, valid)["params"])
    params = params if shift is None else shift(params)

    def loss(p, ids, positions, valid):
        logp = jax.nn.log_softmax(model.apply({"params": p}, ids, positions, valid))
        return -jnp.sum(jnp.take_along_axis(logp, ids[..., None], -1)[..., 0] * valid)

    ref_loss, ref_grads = jax.value_and_grad(loss)(params, ids, positions, valid)
    mesh = section_mesh(SectionPlan((0, 1, 2, 3), mesh_shape(**axes), 1))
    shard, rows_sh = variable_shardings(boxed, mesh, "default")["params"], row_sharding(mesh)
    step = jax.jit(jax.value_and_grad(loss), in_shardings=(shard, rows_sh, rows_sh, rows_sh))
    with on_mesh(mesh, "default"):
        placed = jax.device_put(params, shard)
        got_loss, got_grads = step(placed, ids, positions, valid)
        hlo = step.lower(placed, ids, positions, valid).compile().as_text()
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    return hlo
