"""A user's own four-section graph: picture encoder -> projector -> decoder, with a frozen teacher
distilling into the decoder. Flax modules written here, not taken from `models/`.

    python examples/four_sections.py            # one step against the monolithic step, 8 CPU devices
    python examples/four_sections.py --plan 64  # plan it for 64 H100s (nothing compiled)

The graph is a DAG with a frozen branch (the teacher reads only tokens, so it may run ahead
under `schedule.run_ahead: 1`) and a trained chain (encoder and projector run only for samples
holding pictures). `--plan` is the planner's hard case (thousands of near-equal plans);
benchmarks/RESULTS.md times it. `tests/test_api.py` builds a 3-section graph from the same modules.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts its backend

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import maestro_jax as mj

VOCAB, WIDTH, TEXT0 = 64, 32, 3
PICTURE = mj.Modality("image", placeholder=1, unit=(4, 4), channels=3)


class PatchEncoder(nn.Module):
    @nn.compact
    def __call__(self, pieces_BNF):
        return nn.Dense(24)(nn.gelu(nn.Dense(48)(pieces_BNF)))


class Projector(nn.Module):
    @nn.compact
    def __call__(self, x_BND):
        return nn.Dense(WIDTH)(nn.LayerNorm()(x_BND))


class TinyDecoder(nn.Module):
    """Token embedding, a causal running-mean mixer and an MLP: small but position-aware."""

    width: int = WIDTH

    def setup(self):
        self.embed = nn.Embed(VOCAB, self.width)
        self.mix = nn.Dense(self.width)
        self.out = nn.Dense(VOCAB)

    def embed_ids(self, ids_BL):
        return self.embed(ids_BL)

    def __call__(self, x_BLD, valid_BL):
        w = valid_BL[..., None].astype(x_BLD.dtype)
        mean = jnp.cumsum(x_BLD * w, axis=1) / jnp.maximum(jnp.cumsum(w, axis=1), 1.0)
        return self.out(x_BLD + nn.gelu(self.mix(mean)))


def cut(image):
    """An H x W x C image -> (4x4 patches, their positions), row-major."""
    h, w, c = image.shape
    p = image.reshape(h // 4, 4, w // 4, 4, c).transpose(0, 2, 1, 3, 4).reshape(-1, 48)
    return p, np.arange(len(p))[:, None]


class PictureCaptions:
    """A random-access source: text with 0..2 pictures, a pure function of the index."""

    def __init__(self, size: int = 256):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        pictures = tuple(
            rng.standard_normal((4 * int(rng.integers(1, 3)), 8, 3)).astype(np.float32)
            for _ in range(int(rng.integers(0, 3)))
        )
        text = (TEXT0 + (np.arange(int(rng.integers(6, 14))) * 5 + i) % (VOCAB - TEXT0)).astype(np.int32)
        holes = np.full(sum(PICTURE.tokens(p.shape[:2]) for p in pictures), PICTURE.placeholder, np.int32)
        return mj.Sample(i, np.concatenate([text[:2], holes, text[2:]]), {"image": pictures} if pictures else {})


def graph() -> mj.SectionGraph:
    """The section graph."""
    picture = PICTURE
    encoder, projector, decoder, teacher = PatchEncoder(), Projector(), TinyDecoder(), TinyDecoder(2 * WIDTH)

    def encoder_forward(variables, inputs, batch):
        return {"patch_features": encoder.apply({"params": variables["params"]}, batch["pieces"])}

    def projector_forward(variables, inputs, batch):
        features = mj.rows.gather(inputs, "patch_features", batch["encoder_row"])
        return {"picture_tokens": projector.apply({"params": variables["params"]}, features)}

    def teacher_forward(variables, inputs, batch):
        v = {"params": variables["consts"]["teacher"]}
        x = teacher.apply(v, batch["input_ids"], method=TinyDecoder.embed_ids)
        return {"teacher_logits": teacher.apply(v, x, batch["valid"])}

    def decoder_batch(rows, routes):
        return {
            **mj.rows.text_rows(rows, (picture,)),
            "picture_row": mj.rows.route(routes, "picture_tokens", rows),
            "teacher_row": mj.rows.route(routes, "teacher_logits", rows),
        }

    def decoder_forward(variables, inputs, batch):
        v = {"params": variables["params"]}
        x = decoder.apply(v, batch["input_ids"], method=TinyDecoder.embed_ids)
        x = mj.rows.splice(x, inputs, "picture_tokens", batch["picture_row"], batch["image_tok"])
        logits = decoder.apply(v, x, batch["valid"])
        t_logits = mj.rows.gather(inputs, "teacher_logits", batch["teacher_row"], length=batch["input_ids"].shape[1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        kl = optax.kl_divergence(jax.nn.log_softmax(logits), jax.nn.softmax(t_logits))
        mask = batch["loss_mask"]
        return jnp.sum((ce + kl) * mask), {"tokens": jnp.sum(mask), "kl": jnp.sum(kl * mask)}

    def init(key):
        ke, kp, kd, kt = jax.random.split(key, 4)
        ids, valid = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool)

        def lm(module, k, width):
            return (
                module.init(k, jnp.zeros((1, 4, width)), valid)["params"]
                | module.init(k, ids, method=TinyDecoder.embed_ids)["params"]
            )

        return {
            "encoder": {"params": encoder.init(ke, jnp.zeros((1, 4, 48)))["params"], "consts": {}},
            "projector": {"params": projector.init(kp, jnp.zeros((1, 4, 24)))["params"], "consts": {}},
            "teacher": {"params": {}, "consts": {"teacher": lm(teacher, kt, 2 * WIDTH)}},
            "decoder": {"params": lm(decoder, kd, WIDTH), "consts": {}},
        }

    def patches(sample):
        return sum(h // 4 * (w // 4) for h, w, _ in sample.shapes("image"))

    def lm_flops(width):
        return 2 * (width * width + width * VOCAB)

    return mj.SectionGraph(
        sections=(
            mj.Section(
                "encoder",
                trained=True,
                forward=encoder_forward,
                host_batch=lambda rows, routes: mj.rows.pack_items(rows, "image", cut, features=48),
                activates=lambda s: s.has("image"),
                work=patches,
                cost=mj.UnitCost(flops=2 * (48 * 48 + 48 * 24), width=48),
            ),
            mj.Section(
                "projector",
                trained=True,
                forward=projector_forward,
                host_batch=lambda rows, routes: {"encoder_row": mj.rows.route(routes, "patch_features", rows)},
                activates=lambda s: s.has("image"),
                work=patches,
                cost=mj.UnitCost(flops=2 * 24 * WIDTH),
            ),
            mj.Section(
                "teacher",
                trained=False,
                forward=teacher_forward,
                host_batch=lambda rows, routes: mj.rows.text_rows(rows, (picture,)),
                activates=lambda s: True,
                work=mj.rows.next_token_units,
                cost=mj.UnitCost(flops=lm_flops(2 * WIDTH), width=2 * WIDTH, logits=VOCAB),
            ),
            mj.Section(
                "decoder",
                trained=True,
                forward=decoder_forward,
                host_batch=decoder_batch,
                activates=lambda s: True,
                work=mj.rows.next_token_units,
                cost=mj.UnitCost(flops=lm_flops(WIDTH), width=WIDTH, logits=VOCAB),
            ),
        ),
        edges=(
            mj.Edge("patch_features", "encoder", "projector", bytes_per_unit=2 * 24),
            mj.Edge("picture_tokens", "projector", "decoder", bytes_per_unit=2 * WIDTH),
            mj.Edge("teacher_logits", "teacher", "decoder", bytes_per_unit=4 * VOCAB),
        ),
        init=init,
        loss_count=mj.rows.loss_tokens((picture,)),
    )


def config(**changes):
    """A plan on 8 devices: the teacher and the encoder chain on their own devices."""
    base = {
        "global_batch": 8,
        "steps": 3,
        "seed": 0,
        "optimizer": {"learning_rate": 0.01},
        "sections": {
            "encoder": {"devices": "0:2", "mesh": {"data": 2}, "micro_batch": 2},
            "projector": {"devices": "0:2", "mesh": {"data": 2}, "micro_batch": 2},
            "teacher": {"devices": "2:4", "mesh": {"data": 2}, "micro_batch": 2},
            "decoder": {"devices": "4:8", "mesh": {"data": 4}, "micro_batch": 1},
        },
        "monolithic": {"devices": "0:8", "mesh": {"data": 8}, "micro_batch": 1},
    }
    return mj.Config.model_validate({**base, **changes})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=int, metavar="DEVICES", help="plan for this many H100s instead of verifying")
    args = ap.parse_args(argv)
    if args.plan:
        trainer = mj.Trainer(
            config(simulate={"device": "h100", "batches": 1}),
            graph(),
            PictureCaptions(),
            modalities=(PICTURE,),
            vocab=VOCAB,
        )
        report = trainer.plan(devices=args.plan, memory_gb=80.0, top=3)
        from maestro_jax.planning.planner import format_table

        print(format_table(report))
        return 0
    worst = max(
        d.max_rel for d in mj.Trainer(config(), graph(), PictureCaptions(), modalities=(PICTURE,), vocab=VOCAB).verify()
    )
    print(f"maestro vs monolithic step: largest relative difference {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
