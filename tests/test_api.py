"""The public API with a user's own compound model: Flax modules a user writes (not in models/:
those of examples/four_sections.py),
a 3-section chain (encoder -> projector -> decoder), a user's sample source; trained, checked
against the monolithic step under both schedulers, resumed, planned and simulated."""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import ROOT

import maestro_jax as mj

sys.path.insert(0, str(ROOT / "examples"))
from four_sections import (
    PICTURE,
    VOCAB,
    WIDTH,
    PatchEncoder,
    PictureCaptions,
    Projector,
    TinyDecoder,
    cut,
)


def user_graph():
    encoder, projector, decoder = PatchEncoder(), Projector(), TinyDecoder()

    def encoder_batch(rows, routes):
        return mj.rows.pack_items(rows, "image", cut, features=48)

    def encoder_forward(variables, inputs, batch):
        return {"patch_features": encoder.apply({"params": variables["params"]}, batch["pieces"])}

    def projector_batch(rows, routes):
        return {"encoder_row": mj.rows.route(routes, "patch_features", rows)}

    def projector_forward(variables, inputs, batch):
        features = mj.rows.gather(inputs, "patch_features", batch["encoder_row"])
        return {"picture_tokens": projector.apply({"params": variables["params"]}, features)}

    def decoder_batch(rows, routes):
        return {**mj.rows.text_rows(rows, (PICTURE,)), "picture_row": mj.rows.route(routes, "picture_tokens", rows)}

    def decoder_forward(variables, inputs, batch):
        v = {"params": variables["params"]}
        x = decoder.apply(v, batch["input_ids"], method=TinyDecoder.embed_ids)
        x = mj.rows.splice(x, inputs, "picture_tokens", batch["picture_row"], batch["image_tok"])
        logits = decoder.apply(v, x, batch["valid"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["loss_mask"]), {"tokens": jnp.sum(batch["loss_mask"])}

    def init(key):
        ke, kp, kd = jax.random.split(key, 3)
        return {
            "encoder": {"params": encoder.init(ke, jnp.zeros((1, 4, 48)))["params"], "consts": {}},
            "projector": {"params": projector.init(kp, jnp.zeros((1, 4, 24)))["params"], "consts": {}},
            "decoder": {
                "params": decoder.init(kd, jnp.zeros((1, 4, WIDTH)), jnp.ones((1, 4), bool))["params"]
                | decoder.init(kd, jnp.zeros((1, 4), jnp.int32), method=TinyDecoder.embed_ids)["params"],
                "consts": {},
            },
        }

    patches = lambda s: sum(h // 4 * (w // 4) for h, w, _ in s.shapes("image"))
    return mj.SectionGraph(
        sections=(
            mj.Section(
                "encoder",
                trained=True,
                forward=encoder_forward,
                host_batch=encoder_batch,
                activates=lambda s: s.has("image"),
                work=patches,
                cost=mj.UnitCost(flops=2 * (48 * 48 + 48 * 24), width=48),
            ),
            mj.Section(
                "projector",
                trained=True,
                forward=projector_forward,
                host_batch=projector_batch,
                activates=lambda s: s.has("image"),
                work=patches,
                cost=mj.UnitCost(flops=2 * 24 * WIDTH),
            ),
            mj.Section(
                "decoder",
                trained=True,
                forward=decoder_forward,
                host_batch=decoder_batch,
                activates=lambda s: True,
                work=mj.rows.next_token_units,
                cost=mj.UnitCost(flops=2 * (WIDTH * WIDTH + WIDTH * VOCAB), width=WIDTH, logits=VOCAB),
            ),
        ),
        edges=(
            mj.Edge("patch_features", "encoder", "projector", bytes_per_unit=2 * 24),
            mj.Edge("picture_tokens", "projector", "decoder", bytes_per_unit=2 * WIDTH),
        ),
        init=init,
        loss_count=mj.rows.loss_tokens((PICTURE,)),
    )


DECLARED = {"modalities": (PICTURE,), "vocab": VOCAB}  # what the samples carry: every sample is checked against it


def user_config(**changes):
    base = dict(
        global_batch=8,
        steps=3,
        seed=0,
        optimizer={"learning_rate": 0.01},
        sections={
            "encoder": {"devices": "0:2", "mesh": {"data": 2}, "micro_batch": 2},
            "projector": {"devices": "2:4", "mesh": {"data": 2}, "micro_batch": 2},
            "decoder": {"devices": "4:8", "mesh": {"data": 4}, "micro_batch": 1},
        },
        edges={"patch_features": {"fanout": 1}, "picture_tokens": {"fanout": 2}},
        monolithic={"devices": "0:8", "mesh": {"data": 8}, "micro_batch": 1},
    )
    return mj.Config.model_validate({**base, **changes})


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["naive", "wavefront"])
def test_user_graph_matches_the_monolithic_step(scheduler):
    trainer = mj.Trainer(user_config(schedule={"scheduler": scheduler}), user_graph(), PictureCaptions(), **DECLARED)
    diffs = {d.name: d for d in trainer.verify()}
    assert set(diffs) == {"loss", "grad_norm"} | {
        f"{s}/{q}" for s in ("encoder", "projector", "decoder") for q in ("grads", "params_after_update")
    }
    for d in diffs.values():
        assert d.max_rel < 1e-5, d
    schedule = trainer.runtime.schedule(trainer.runtime.batches()[0])
    assert schedule.name == scheduler
    assert schedule.steps["encoder"] and schedule.steps["projector"], "the batch exercised the whole chain"


@pytest.mark.slow
def test_user_graph_trains_and_resumes_exactly(tmp_path):
    straight = mj.Trainer(user_config(steps=4), user_graph(), PictureCaptions(), **DECLARED).train(progress=False)
    assert straight[-1]["train/loss"] < straight[0]["train/loss"]
    run = str(tmp_path / "run")
    first = mj.Trainer(user_config(steps=2, output_dir=run), user_graph(), PictureCaptions(), **DECLARED).train(
        progress=False
    )
    rest = mj.Trainer(user_config(steps=4, output_dir=run), user_graph(), PictureCaptions(), **DECLARED).train(
        progress=False
    )
    assert [h["step"] for h in rest] == [3, 4], "resumed from the step-2 checkpoint"
    assert [h["train/loss"] for h in first + rest] == [h["train/loss"] for h in straight]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_user_graph_plans_and_simulates_every_section():
    trainer = mj.Trainer(
        user_config(simulate={"device": "cpu", "batches": 1}), user_graph(), PictureCaptions(), **DECLARED
    )
    report = trainer.plan(devices=8, memory_gb=1.0, top=2)
    best = report.best.plan
    assert set(best.sections) == {"encoder", "projector", "decoder"}
    encoder, projector = best.sections["encoder"].dp, best.sections["projector"].dp
    assert best.fanout.get("patch_features", projector / encoder) * encoder == projector
    sim = trainer.simulate()
    assert sim["sections"] == ["encoder", "projector", "decoder"]
    assert set(sim["busy_s"]) == {"encoder", "projector", "decoder"} and sim["busy_s"]["projector"] > 0


def test_user_graph_with_a_wrong_plan_refuses_before_compiling():
    bad = user_config(
        sections={
            "encoder": {"devices": "0:2", "mesh": {"data": 2}},
            "decoder": {"devices": "2:8", "mesh": {"data": 6}},
        }
    )
    with pytest.raises(mj.ConfigError, match=r"sections=\['decoder', 'encoder'\]: the graph has sections"):
        mj.Trainer(bad, user_graph(), PictureCaptions(), **DECLARED)


class Mistaken(PictureCaptions):
    """PictureCaptions with a mistake a user makes, in every sample that holds a picture."""

    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def __getitem__(self, i):
        s = super().__getitem__(i)
        if not s.items:
            return s
        if self.mistake == "token list":
            return mj.Sample(s.id, s.tokens.tolist(), s.items)
        holes = s.tokens == PICTURE.placeholder
        return mj.Sample(s.id, s.tokens[~(holes & (holes.cumsum() == 1))], s.items)  # one placeholder dropped


@pytest.mark.parametrize(
    "mistake,message",
    [
        ("token list", r"sample id=\d+: tokens must be a 1-D integer array"),
        ("missing placeholder", r"sample id=\d+: (\d+) image-placeholder tokens but its image items need (\d+)"),
    ],
)
def test_a_user_graphs_samples_are_validated_by_default(mistake, message):
    """No `check` given: the samples are still validated, against the modalities and vocabulary
    the user declared; a token list or a missing placeholder is a DataError naming the sample,
    when the Trainer is built, before anything compiles (it used to train with zero encoder
    gradients, then to fail only after the programs compiled)."""
    with pytest.raises(mj.DataError, match=message) as err:
        mj.Trainer(user_config(), user_graph(), Mistaken(mistake), **DECLARED)
    assert "Trainer(modalities=..., vocab=...)" in str(err.value)
    if mistake == "missing placeholder":
        found, need = re.search(message, str(err.value)).groups()
        assert int(found) == int(need) - 1


def test_a_source_of_dicts_is_named_before_anything_compiles():
    """A source returning each sample's fields as a dict, not `mj.Sample`: one DataError naming
    the index, what it returned and the constructor (it used to be `AttributeError: 'dict' object
    has no attribute 'id'` from inside the data checks)."""
    from conftest import compiles

    class Dicts(PictureCaptions):
        def __getitem__(self, i):
            s = super().__getitem__(i)
            return {"id": s.id, "tokens": s.tokens, "items": s.items}

    with compiles() as compiled, pytest.raises(mj.DataError) as err:
        mj.Trainer(user_config(), user_graph(), Dicts(), **DECLARED)
    assert str(err.value) == (
        "source[0] is a dict with keys ['id', 'items', 'tokens'], not a Sample; a source's items are "
        "maestro_jax.Sample(id, tokens, items) (maestro_jax.data.Sample)"
    )
    assert compiled == []


def test_undeclared_modalities_are_refused_before_anything_compiles_naming_where_to_declare():
    """A user graph whose samples hold pictures, built without `modalities`: the first batch is
    checked when the Trainer is built, and the error says what was declared and where."""
    with pytest.raises(mj.DataError) as err:
        mj.Trainer(user_config(), user_graph(), PictureCaptions(), vocab=VOCAB)
    assert re.fullmatch(
        r"sample id=\d+: has image items, but this workload takes text only \(checked against what "
        r"Trainer\(modalities=\.\.\., vocab=\.\.\.\) declares: modalities none, text only, vocab "
        + str(VOCAB)
        + r"; declare what your samples carry\)",
        str(err.value),
    ), str(err.value)


def test_under_on_bad_sample_skip_only_a_first_batch_with_no_good_sample_is_refused():
    """`data.on_bad_sample: skip` drops bad samples in training, so the check before compiling
    stops only a first batch with no good sample: one bad sample builds; every sample's
    pictures undeclared does not."""

    class FirstBad(PictureCaptions):
        def __getitem__(self, i):
            s = super().__getitem__(i)
            return mj.Sample(s.id, s.tokens.tolist(), s.items) if i == 0 else s

    skip = {"on_bad_sample": "skip"}
    mj.Trainer(user_config(data=skip), user_graph(), FirstBad(), **DECLARED)  # builds
    with pytest.raises(
        mj.DataError, match=r"^sample id=0: has image items, .*the first batch's other 7 samples fail too$"
    ):
        mj.Trainer(user_config(data=skip), user_graph(), PictureCaptions(), vocab=VOCAB)


def test_a_callback_that_reads_the_items_fails_in_verify_as_in_train_naming_the_section():
    """`activates` and `work` receive the sample's SampleInfo on every path: one reading
    `sample.items` used to pass `verify` (whole samples) and fail in `train` (metadata)."""
    import dataclasses

    from maestro_jax.core.graph import GraphError

    graph = user_graph()
    encoder = dataclasses.replace(graph.section("encoder"), activates=lambda s: "image" in s.items)
    graph = dataclasses.replace(graph, sections=(encoder, *graph.sections[1:]))
    trainer = mj.Trainer(user_config(), graph, PictureCaptions(), **DECLARED)
    for run in (trainer.verify, lambda: trainer.train(progress=False)):
        with pytest.raises(
            GraphError, match=r"^error: section 'encoder': activates\(sample\) failed on sample id=\d+ "
        ):
            run()


def test_a_section_without_a_declared_cost_is_refused_by_plan_and_simulate():
    """A missing UnitCost used to make the section free in `plan` and `simulate`."""
    import dataclasses

    from maestro_jax.core.graph import GraphError

    graph = user_graph()
    projector = dataclasses.replace(graph.section("projector"), cost=mj.UnitCost(flops=0.0))
    graph = dataclasses.replace(
        graph, sections=tuple(projector if s.name == "projector" else s for s in graph.sections)
    )
    trainer = mj.Trainer(user_config(simulate={"device": "cpu", "batches": 1}), graph, PictureCaptions(), **DECLARED)
    message = r"^error: section 'projector': declares no cost \(Section.cost has no FLOPs per work unit\)"
    for run in (lambda: trainer.plan(devices=8, memory_gb=1.0), trainer.simulate):
        with pytest.raises(GraphError, match=message):
            run()


def _with(graph, name, **changes):
    import dataclasses

    return dataclasses.replace(
        graph, sections=tuple(dataclasses.replace(s, **changes) if s.name == name else s for s in graph.sections)
    )


def _mistakes():
    """(mistake, graph, the error's start) for the mistakes a user's graph makes."""
    import dataclasses

    graph = user_graph()
    projector = Projector()

    def narrow(variables, inputs, batch):  # the projector returns half the width the decoder splices
        features = mj.rows.gather(inputs, "patch_features", batch["encoder_row"])
        return {"picture_tokens": projector.apply({"params": variables["params"]}, features)[..., : WIDTH // 2]}

    def misnamed(variables, inputs, batch):
        features = mj.rows.gather(inputs, "patch_features", batch["encoder_row"])
        return {"picture_token": projector.apply({"params": variables["params"]}, features)}

    def without_row(rows, routes):  # forgets the route the decoder's forward reads
        return mj.rows.text_rows(rows, (PICTURE,))

    def missing_init(key):
        return {k: v for k, v in graph.init(key).items() if k != "projector"}

    decoder = graph.section("decoder")

    def ragged(rows, routes):  # each row's ids as long as its sample: a list of lists
        batch = decoder.host_batch(rows, routes)
        return {**batch, "input_ids": [list(r[: 3 + i]) for i, r in enumerate(batch["input_ids"])]}

    def objects(rows, routes):
        batch = decoder.host_batch(rows, routes)
        return {**batch, "input_ids": batch["input_ids"].astype(object)}

    def loss_alone(variables, inputs, batch):  # the sink's loss without its metrics
        return decoder.forward(variables, inputs, batch)[0]

    return [
        (
            "wrong width",
            _with(graph, "projector", forward=narrow),
            r"^error: section 'decoder': its \w+ program cannot be traced on this batch's shapes \(inputs \{picture_tokens: \(float32\[\d+, \d+, 16\]",
        ),
        (
            "wrong output key",
            _with(graph, "projector", forward=misnamed),
            r"^error: section 'projector': forward returns \['picture_token'\], without its out-edge 'picture_tokens'",
        ),
        (
            "missing batch key",
            _with(graph, "decoder", host_batch=without_row),
            r"^error: section 'decoder': its \w+ program cannot be traced .*KeyError: 'picture_row'",
        ),
        (
            "missing init entry",
            dataclasses.replace(graph, init=missing_init),
            r"^error: section 'projector': the graph's init returns nothing for it",
        ),
        (
            "ragged host_batch",
            _with(graph, "decoder", host_batch=ragged),
            r"^error: section 'decoder': host_batch returns 'input_ids' as no array of one shape \(setting an array "
            r"element with a sequence.*; host_batch returns numpy arrays, each row of a key the same shape",
        ),
        (
            "object host_batch",
            _with(graph, "decoder", host_batch=objects),
            r"^error: section 'decoder': host_batch returns 'input_ids' of dtype object; host_batch returns bool, "
            r"integer or float arrays$",
        ),
        (
            "sink without metrics",
            _with(graph, "decoder", forward=loss_alone),
            r"^error: section 'decoder': forward returns one array \(float32\[\]\); the sink section returns "
            r"\(loss summed over the batch, \{metric name: array\}\), an empty dict for no metrics",
        ),
    ]


MISTAKES = [
    "wrong width",
    "wrong output key",
    "missing batch key",
    "missing init entry",
    "ragged host_batch",
    "object host_batch",
    "sink without metrics",
]


@pytest.mark.parametrize("mistake", range(len(MISTAKES)), ids=MISTAKES)
def test_a_user_graphs_mistakes_are_named_before_any_compile(mistake):
    """Each mistake is one GraphError naming the section (and the edge or key), raised by the
    abstract walk of the first batch before anything compiles (they used to surface after
    several compiles as raw JAX or flax errors naming neither)."""
    from conftest import compiles

    from maestro_jax.core.graph import GraphError

    name, graph, message = _mistakes()[mistake]
    assert name == MISTAKES[mistake]
    with compiles() as compiled, pytest.raises(GraphError, match=message):
        mj.Trainer(user_config(), graph, PictureCaptions(), **DECLARED).verify()
    assert compiled == [], compiled


def test_planning_half_imports_without_jax():
    """core, schedule and planning are plain Python: importable with JAX made unimportable."""
    code = (
        "import sys; sys.modules['jax'] = None; sys.modules['flax'] = None\n"
        "import maestro_jax.core.graph, maestro_jax.core.plan, maestro_jax.schedule, maestro_jax.planning.planner\n"
        "import maestro_jax.planning.cluster, maestro_jax.planning.spec, maestro_jax.config\n"
        "import maestro_jax as mj; assert mj.Section.__module__ == 'maestro_jax.core.graph'\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "ok", proc.stderr
