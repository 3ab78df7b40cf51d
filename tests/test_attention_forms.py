"""models/attention.py: the fast forms a fused kernel takes instead of a dense mask, checked where
a CPU can check them. The chooser picks each form for a GPU backend and the mask on CPU (backend,
dtype, jax version and compute capability as inputs); each form, rebuilt as the mask it means,
equals the mask the models build from the rows the host builds (causal, padded, packed, image-span
and windowed rows); and XLA's `is_causal`/length/window forms give the mask path's loss and
gradients."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maestro_jax.models import DecoderLM, LLMConfig, VisionEncoder, ViTConfig
from maestro_jax.models.attention import (
    Mask,
    choose_kernel,
    fast_forms_forced,
    kernel_for,
    packed_offsets,
    segment_lengths,
    segment_lengths_wanted,
)
from maestro_jax.models.layers import item_mask
from maestro_jax.models.llm import decoder_mask, image_blocks

from maestro_jax.data.samples import Sample
from maestro_jax.workloads import rows as R

BF16 = jnp.bfloat16


@pytest.mark.parametrize(
    ("platform", "dtype", "capability", "version", "offered", "split", "expected"),
    [
        ("gpu", BF16, 9.0, (0, 10, 2), "causal", 1, ("cudnn", "causal")),
        ("gpu", BF16, 8.0, (0, 10, 2), "padded", 1, ("cudnn", "padded")),  # the public API, any card
        ("gpu", BF16, 9.0, (0, 11, 2), "packed", 1, ("cudnn", "packed")),
        ("gpu", BF16, 9.0, (0, 12, 0), "packed", 1, ("cudnn", "packed")),
        ("gpu", BF16, 9.0, (0, 11, 0), "packed", 1, ("cudnn", "mask")),  # the GQA offsets bug
        ("gpu", BF16, 9.0, (0, 10, 2), "packed", 1, ("cudnn", "mask")),
        ("gpu", BF16, 8.0, (0, 11, 2), "packed", 1, ("cudnn", "mask")),  # Ampere: no packed layout
        ("gpu", BF16, 9.0, (0, 11, 2), "causal", 2, ("cudnn", "mask")),  # a context split
        ("gpu", BF16, 9.0, (0, 11, 2), "mask", 1, ("cudnn", "mask")),  # image blocks: nothing offered
        ("gpu", jnp.float32, 9.0, (0, 11, 2), "causal", 1, ("xla", "mask")),  # float32: XLA, the mask
        ("cpu", BF16, 0.0, (0, 10, 2), "causal", 1, ("xla", "mask")),
        ("cpu", jnp.float32, 0.0, (0, 10, 2), "packed", 1, ("xla", "mask")),
    ],
)
def test_the_chooser_takes_each_fast_form_on_a_gpu_and_the_mask_elsewhere(
    platform, dtype, capability, version, offered, split, expected
):
    k = choose_kernel(platform, dtype, 128, 4096, 4096, capability, version, offered, split)
    assert (k.implementation, k.form) == expected and k.why


def test_forced_forms_run_on_xla_where_xla_can():
    assert choose_kernel("cpu", jnp.float32, 16, 8, 8, 0.0, (0, 10, 2), "causal", forced=True).form == "causal"
    assert choose_kernel("cpu", jnp.float32, 16, 8, 8, 0.0, (0, 10, 2), "padded", forced=True).form == "padded"
    packed = choose_kernel("cpu", jnp.float32, 16, 8, 8, 0.0, (0, 10, 2), "packed", forced=True)
    assert packed.form == "mask" and "cuDNN" in packed.why


def test_host_segment_lengths_and_offsets_are_cudnns_packed_layout():
    segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1] * 8, [0] * 8])
    lengths = segment_lengths(segments)
    assert lengths.tolist() == [[3, 2, 1, -1], [8, -1, -1, -1], [-1, -1, -1, -1]]  # 3 segments: 4 columns
    assert np.asarray(packed_offsets(jnp.asarray(lengths))).tolist() == [
        [0, 3, 5, -1, -1],
        [0, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1],
    ]
    assert segment_lengths(np.array([[1, 1, 0]])).shape == (1, 1)


def _text_samples(lengths):
    rng = np.random.default_rng(0)
    return [
        None if n is None else Sample(i, rng.integers(3, 50, n + 1).astype(np.int32)) for i, n in enumerate(lengths)
    ]


def _same_where_read(mask: Mask, form: str, read_BQ):
    """The form's mask equals the dense one on every query row the loss reads, and leaves no
    query row without a key (no kernel returns NaN)."""
    _, q, k = mask.dense.shape
    implied, dense = np.asarray(mask.implied(form, q, k)), np.asarray(mask.dense)
    read_BQ = np.asarray(read_BQ, bool)
    assert (implied[read_BQ] == dense[read_BQ]).all()
    assert implied.any(-1).all()
    return implied


@pytest.mark.parametrize("window", [None, 3])
def test_the_causal_form_means_the_decoders_mask_on_text_rows(window):
    batch = R.text_rows(_text_samples([7, 3, None, 12]))
    mask, window_BLL = decoder_mask(
        jnp.asarray(batch["positions"]), jnp.asarray(batch["valid"]), window, from_zero=True
    )
    mask = mask.windowed(window_BLL, window) if window else mask
    assert mask.offered == "causal"
    _same_where_read(mask, "causal", batch["valid"])


def test_the_packed_form_means_the_decoders_mask_on_packed_rows():
    samples = _text_samples([5, 3, 9, 2, 4, None, 6, 1, 3, 2, 7, None])
    with fast_forms_forced():
        batch = R.packed_text_rows(samples, {}, 2, 3)
    assert "segment_lengths" in batch
    seg = jnp.asarray(batch["segments"])
    mask, _ = decoder_mask(
        jnp.asarray(batch["positions"]), jnp.asarray(batch["valid"]), None, seg, None, batch["segment_lengths"]
    )
    assert mask.offered == "packed"
    _same_where_read(mask, "packed", batch["valid"])
    windowed, window_BLL = decoder_mask(
        jnp.asarray(batch["positions"]), jnp.asarray(batch["valid"]), 2, seg, None, batch["segment_lengths"]
    )
    assert windowed.windowed(window_BLL, 2).offered == "mask"  # no kernel form takes both here


@pytest.mark.parametrize(("images", "form"), [((1, 1, 1), "padded"), ((2, 1, 3), "packed")])
def test_the_padded_and_packed_forms_mean_the_towers_mask_on_image_rows(images, form):
    rng = np.random.default_rng(1)
    samples = [
        Sample(i, np.arange(4, dtype=np.int32), {"image": tuple(rng.random((8, 8, 3)) for _ in range(n))})
        for i, n in enumerate(images)
    ]

    def cut(im):
        return im.reshape(-1, 3)[:: 4 + 0], np.zeros((16, 2), np.int32)

    with fast_forms_forced():
        batch = R.pack_items(samples, "image", cut, 3, minimum=4)
    mask = item_mask(jnp.asarray(batch["segments"]), jnp.asarray(batch["segment_lengths"]))
    assert mask.offered == form
    _same_where_read(mask, form, batch["segments"] > 0)


def test_image_span_rows_offer_only_the_mask():
    batch = R.text_rows(_text_samples([6, 4]))
    spans = np.zeros(batch["valid"].shape, bool)
    spans[0, 1:3] = spans[1, 0:2] = True
    images = jnp.asarray(image_blocks(spans))
    mask, _ = decoder_mask(jnp.asarray(batch["positions"]), jnp.asarray(batch["valid"]), None, None, images)
    assert mask.offered == "mask"


def test_rows_builders_send_segment_lengths_only_where_a_kernel_may_take_them():
    samples = _text_samples([5, 3])
    assert jax.default_backend() == "cpu" and not segment_lengths_wanted()
    assert "segment_lengths" not in R.packed_text_rows(samples, {}, 1, 2)
    with fast_forms_forced():
        assert segment_lengths_wanted() and "segment_lengths" in R.packed_text_rows(samples, {}, 1, 2)


LLM = LLMConfig(vocab=64, width=32, depth=3, heads=4, kv_heads=2, head_dim=8, mlp=64)


@pytest.mark.parametrize(
    "cfg",
    [LLM, dataclasses.replace(LLM, sliding_window=3, global_every=3)],
    ids=["causal", "windowed_layers"],
)
def test_xlas_fast_forms_give_the_mask_paths_loss_and_gradients(cfg):
    batch = R.text_rows(_text_samples([9, 4, None, 6]))
    ids, pos, valid = (jnp.asarray(batch[k]) for k in ("input_ids", "positions", "valid"))
    noise = np.random.default_rng(3).integers(1, cfg.vocab, ids.shape)
    ids = jnp.where(valid, ids, jnp.asarray(noise, jnp.int32))  # padding the loss never reads
    model = DecoderLM(cfg, rows_from_zero=True)
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, pos, valid)["params"])
    read = jnp.asarray(batch["loss_mask"])

    def loss(p):
        logits = model.apply({"params": p}, ids, pos, valid)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * read)

    def hidden(p):
        return model.apply(
            {"params": p}, model.apply({"params": p}, ids, method=DecoderLM.embed), pos, valid, method=DecoderLM.hidden
        )

    masked = jax.value_and_grad(loss)(params), hidden(params)
    with fast_forms_forced():
        q = jnp.zeros((4, ids.shape[1], cfg.heads, cfg.head_dim))
        m, _ = decoder_mask(pos, valid, cfg.sliding_window, from_zero=True)
        assert kernel_for(q, q[:, :, : cfg.kv_heads], m, 1).form == "causal"
        fast = jax.value_and_grad(loss)(params), hidden(params)
    (l1, g1), h1 = masked
    (l2, g2), h2 = fast
    assert np.allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)
    v = np.asarray(valid)
    assert np.allclose(np.asarray(h1)[v], np.asarray(h2)[v], atol=1e-5)
    assert not np.allclose(np.asarray(h1)[2], np.asarray(h2)[2], atol=1e-3)  # the empty row: another path ran


# slow: the quick tier's test_the_padded_and_packed_forms_mean_the_towers_mask_on_image_rows holds the
# padded form's meaning (the tower's mask) and test_xlas_fast_forms_give_the_mask_paths_loss_and_gradients[causal]
# the XLA form's numbers
@pytest.mark.slow
def test_xlas_padded_form_gives_the_towers_mask_path_features_and_gradients():
    vit = ViTConfig(patch=2, channels=3, width=16, depth=2, heads=2, mlp=32, out_width=16)
    rng = np.random.default_rng(2)
    patches = jnp.asarray(rng.standard_normal((3, 16, vit.patch_features)), jnp.float32)
    segments = jnp.asarray(np.array([[1] * 16, [1] * 10 + [0] * 6, [1] * 4 + [0] * 12]), jnp.int32)
    grid = jnp.asarray(
        np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(1, 16, 2).repeat(3, 0)
    )
    lengths = jnp.asarray(segment_lengths(np.asarray(segments)))
    model = VisionEncoder(vit)
    params = nn.meta.unbox(model.init(jax.random.key(0), patches, segments, grid)["params"])
    read = np.asarray(segments > 0)

    def features(p):
        return model.apply({"params": p}, patches, segments, grid, None, lengths, method=VisionEncoder.features)[1]

    def loss(p):
        return jnp.sum(features(p) * jnp.asarray(read)[..., None] * jnp.arange(16.0))

    l1, g1 = jax.value_and_grad(loss)(params)
    f1 = features(params)
    with fast_forms_forced():
        l2, g2 = jax.value_and_grad(loss)(params)
        f2 = features(params)
    assert np.allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.asarray(f1)[read], np.asarray(f2)[read], atol=1e-5)
    assert not np.allclose(np.asarray(f1)[~read], np.asarray(f2)[~read], atol=1e-3)  # padding: another path


def test_rows_a_caller_builds_keep_the_dense_mask_unless_laid_from_position_zero():
    """Left padding (valid positions at a row's end) is not what `is_causal` with lengths says: a
    DecoderLM the caller builds takes the dense mask; the workloads' decoders, fed `text_rows`'
    rows, say `rows_from_zero` and offer the causal form."""
    valid = jnp.asarray(np.arange(8)[None] >= np.array([[3], [0]]))  # row 0 left-padded by 3
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    assert decoder_mask(positions, valid)[0].offered == "mask"
    laid, _ = decoder_mask(jnp.broadcast_to(jnp.arange(8), (2, 8)), valid[:, ::-1], from_zero=True)
    assert laid.offered == "causal"
    assert not DecoderLM(LLM).rows_from_zero


def test_each_distinct_attention_choice_is_logged_once(caplog):
    """`kernel_for` says its choice in one log line per distinct (backend, dtype, head size,
    offered form, choice): a second layer or step with the same arrays says nothing again, rows
    offering another form say their own line once."""
    import logging

    from maestro_jax.models import attention

    attention._log_choice.cache_clear()  # once a process: as if nothing had been said yet
    q, k = jnp.zeros((2, 8, 4, 16), jnp.float32), jnp.zeros((2, 8, 2, 16), jnp.float32)
    causal = attention.Mask(jnp.ones((2, 8, 8), bool), lengths=jnp.array([8, 5]), causal=True)
    padded = attention.Mask(jnp.ones((2, 8, 8), bool), lengths=jnp.array([8, 5]))
    with caplog.at_level(logging.INFO, logger="maestro_jax"):
        for mask in (causal, causal, padded, causal, padded):
            attention.kernel_for(q, k, mask, context_split=1)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention on ")]
    assert len(said) == 2, said
    assert "rows offering causal: xla with the mask form" in said[0] and "rows offering padded" in said[1]


def test_a_softcapped_attention_stays_on_the_mask_path_even_with_fast_forms_forced(monkeypatch):
    """Gemma 2's score cap (c * tanh(s / c), before the mask) is something no fused kernel does:
    with rows offering the causal form and fast forms forced, `layers.attention` never asks the
    chooser for a kernel and gives the capped scores' attention over the dense mask, computed
    here by hand; the uncapped call does ask, and differs."""
    from maestro_jax.models import attention as A
    from maestro_jax.models import layers

    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) * 3 for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    lengths = jnp.array([6, 4])
    causal = jnp.tril(jnp.ones((6, 6), bool))[None] & (jnp.arange(6)[None, None, :] < lengths[:, None, None])
    mask = A.Mask(causal, lengths=lengths, causal=True)
    asked = []
    chooser = A.kernel_for
    monkeypatch.setattr(layers, "kernel_for", lambda *a: asked.append(1) or chooser(*a))
    with A.fast_forms_forced():
        capped = layers.attention(q, k, v, mask, softcap=2.0)
        assert asked == []
        plain = layers.attention(q, k, v, mask)
        assert asked == [1]
    kq = jnp.repeat(k, 2, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kq) / np.sqrt(8)
    s = jnp.where(causal[:, None], 2.0 * jnp.tanh(s / 2.0), -jnp.inf)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), jnp.repeat(v, 2, axis=2))
    rows = np.arange(6)[None, :] < np.asarray(lengths)[:, None]  # the rows the loss reads
    np.testing.assert_allclose(np.asarray(capped)[rows], np.asarray(want)[rows], rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(plain)[rows], np.asarray(want)[rows], atol=1e-3)
