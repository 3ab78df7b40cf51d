"""Knowledge distillation: frozen teachers -> a trained `student` (holds the loss).

As in production KD each teacher section sends its final hidden states (hidden << vocabulary)
and the teacher's output layer runs inside the student section, as a frozen constant there.
loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE, summed over target tokens.

One teacher is `models.teacher` (section `teacher`). Several are `models.teachers: {name:
{...}}` (`config.DistillConfig`): each its own frozen section `<name>` with its own devices,
mesh, micro-batch and precision, sending edge `<name>_hidden`; the student holds each one's
output layer (`<name>_head`) and learns from their tempered distributions mixed by
`distill.combine.weights` (`teacher_log_probs`), or each sample from the one teacher its tag
names (`distill.combine.mode: route`, `Routing`): a teacher section then activates only for the
samples routed to it, as a vision section does only for samples with images, so a teacher no
sample of a batch routes to runs nothing for it, and the planner prices it so.

`distill.top_k: K` keeps the teachers' distribution to its K likeliest tokens and the rest as one
outcome (`sparse_kl`); `distill.cache: DIR` reads those top-k outputs from a teacher cache
instead of running any teacher (`build_cached`, `kd_cached`): the student alone, the same loss.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maestro_jax.config import Config, ConfigError
from maestro_jax.core.graph import Edge, Section, SectionGraph
from maestro_jax.data.samples import TOKENS, DataError
from maestro_jax.data.teacher_cache import TEACHER_PART
from maestro_jax.models import DecoderLM, LLMConfig, apply_with_losses, softcap
from maestro_jax.workloads import Workload, kd_cached, model
from maestro_jax.workloads import rows as R
from maestro_jax.workloads.costs import llm_cost
from maestro_jax.workloads.pretrained import load_llm_section, load_teacher_section
from maestro_jax.workloads.staged import decoder_stages

EDGE = "teacher_hidden"  # the edge of the one teacher named `teacher`


@dataclasses.dataclass(frozen=True)
class Teacher:
    """One frozen teacher: the model and the section of its name, the hidden states it sends
    (edge `<name>_hidden`), the output layer the student holds for it (`<name>_head`) and its
    share of the mixed distribution (the weights normalised to sum to 1)."""

    name: str
    model: LLMConfig
    weight: float = 1.0

    @property
    def edge(self) -> str:
        return f"{self.name}_hidden"

    @property
    def head(self) -> str:
        return f"{self.name}_head"

    @property
    def row(self) -> str:
        """The student batch's key holding each row's index into this teacher's outputs."""
        return f"{self.edge}_row"


def teachers_of(cfg: Config) -> tuple[Teacher, ...]:
    """The config's teachers in order (`distill.teachers`, else the one `models.teacher`), each
    with its normalised weight; a ConfigError of one line for a vocabulary that differs from the
    first teacher's."""
    names = cfg.distill.teachers or ("teacher",)
    weights = cfg.distill.combine.weights
    raw = [float(weights.get(n, 1.0)) for n in names]
    out = tuple(Teacher(n, model(cfg, n, "llm"), w / sum(raw)) for n, w in zip(names, raw))
    first = out[0]
    for t in out[1:]:
        if t.model.vocab != first.model.vocab:
            raise ConfigError(
                f"error: models.{t.name}.vocab={t.model.vocab}: differs from models.{first.name}.vocab="
                f"{first.model.vocab} (the teachers' distributions are mixed token by token); valid: "
                f"{first.model.vocab}"
            )
    return out


@dataclasses.dataclass(frozen=True)
class Routing:
    """`distill.combine.mode: route`: the teacher of a sample is the one its tag `field` names,
    through `routes` (tag value -> teacher) where listed, else by the teacher's own name; a
    sample without the tag goes to `default`."""

    field: str
    routes: dict[str, str]
    default: str | None
    names: tuple[str, ...]

    def teacher(self, sample) -> str:
        """The name of `sample`'s teacher (a `Sample` or its `SampleInfo`); DataError naming the
        sample when its tag names none (a bad sample: `data.on_bad_sample` refuses or skips it)."""
        value = sample.tags.get(self.field)
        if value is None:
            if self.default is None:
                raise DataError(
                    f"sample id={sample.id}: has no tag {self.field!r} (distill.combine.field), and "
                    f"distill.combine.default is not set; valid: a tag naming one of {', '.join(self.names)}"
                )
            return self.default
        name = self.routes.get(value, value)
        if name not in self.names:
            raise DataError(
                f"sample id={sample.id}: tag {self.field}={value!r} routes to no teacher; valid: "
                f"{', '.join(self.names)}, or a value distill.combine.routes sends to one"
            )
        return name


def routing_of(cfg: Config) -> Routing | None:
    """The config's `Routing` (None: the teachers' distributions are mixed, `mode: mean`)."""
    c = cfg.distill.combine
    if c.mode != "route":
        return None
    return Routing(c.field, dict(c.routes), c.default, tuple(t.name for t in teachers_of(cfg)))


def sample_rule(cfg: Config):
    """Every sample's tag names a teacher (routing only): `Workload.sample_rule`."""
    routing = routing_of(cfg)
    return None if routing is None else routing.teacher


def teacher_section(
    teacher: LLMConfig,
    modalities=(),
    edge: str = EDGE,
    *,
    per_octave: int,
    name: str = "teacher",
    routing: Routing | None = None,
) -> Section:
    """A frozen LLM body `name`: token rows in (bucketed at `per_octave`, `compile.buckets_per_octave`),
    final-normed hidden states out on `edge` (its head runs downstream); under `routing`, only
    for the samples routed to `name`.
    It splits into pipeline stages (`workloads.staged`), forward only, the last sending `edge`."""
    body = DecoderLM(teacher, with_head=False, rows_from_zero=True)  # text_rows' rows

    def forward(variables, inputs, batch):
        v = {"params": variables["consts"]["llm"]}
        x = body.apply(v, batch["input_ids"], method=DecoderLM.embed)
        if "segments" not in batch:
            return {edge: body.apply(v, x, batch["positions"], batch["valid"], method=DecoderLM.hidden)}
        packed = (batch["segments"], None, None, batch.get("segment_lengths"))
        h = body.apply(v, x, batch["positions"], batch["valid"], *packed, method=DecoderLM.hidden)
        return {edge: R.unpack(h, batch)}  # packed: back to one row per sample, as the edge carries it

    def stages(k: int, layers: tuple[int, ...] | None = None):
        return decoder_stages(
            section,
            teacher,
            k,
            layers=layers,
            finish=lambda module, variables, v, inputs, batch, h: {edge: h},
            cost=lambda c, last: llm_cost(c, head=False),
            at=("consts", "llm"),
            with_head=False,
        )

    section = Section(
        name,
        trained=False,
        forward=forward,
        host_batch=lambda rows, routes: R.text_rows(rows, modalities, per_octave=per_octave),
        packed_batch=lambda rows, routes, shards, pack: R.packed_text_rows(
            rows, {}, shards, pack, modalities, unpacks=True, per_octave=per_octave
        ),
        activates=(lambda s: True) if routing is None else (lambda s: routing.teacher(s) == name),
        work=R.next_token_units,
        cost=llm_cost(teacher, head=False),
        reads=(TOKENS,),
        stages=stages,
    )
    return section


def teacher_sections(teachers: tuple[Teacher, ...], routing: Routing | None, modalities=(), *, per_octave: int):
    """One frozen `teacher_section` per teacher, each sending its own edge (and, under `routing`,
    running only its samples)."""
    return tuple(
        teacher_section(t.model, modalities, edge=t.edge, per_octave=per_octave, name=t.name, routing=routing)
        for t in teachers
    )


def teacher_hidden(inputs, batch, edge: str):
    """The teacher's hidden state at each student position: its row's (`<edge>_row`), or in a
    packed student row each position's own sample's at the sample's position."""
    if "segments" in batch:
        return R.gather_tokens(inputs, edge, batch[f"{edge}_row"], batch["positions"])
    return R.gather(inputs, edge, batch[f"{edge}_row"], length=batch["input_ids"].shape[1])


def teacher_log_probs(
    variables, inputs, batch, teachers: tuple[Teacher, ...], temperature: float, routed: bool = False
):
    """Log-probabilities of the teachers' tempered distributions at each student position, with
    z_i teacher i's logits (its hidden states through the output layer the student holds).

    Mixed (`mode: mean`): log sum_i w_i softmax(z_i / T); one teacher: its log_softmax(z_i / T)
    itself. `routed`: each row's own teacher's log_softmax(z_i / T), the teacher whose edge routes
    to the row (`<edge>_row` >= 0); a teacher no row routes to (its input None) is left out."""
    logps = {}
    for t in teachers:
        if inputs.get(t.edge) is None:
            continue
        hidden = teacher_hidden(inputs, batch, t.edge)
        logps[t] = tempered_log_probs(hidden, variables["consts"][t.head], t.model, temperature)
    if routed:
        return _routed(logps, batch)
    if len(logps) == 1:
        return next(iter(logps.values()))
    log_w = jnp.log(jnp.asarray([t.weight for t in logps], jnp.float32))
    return jax.nn.logsumexp(jnp.stack(list(logps.values())) + log_w[:, None, None, None], axis=0)


def tempered_log_probs(hidden, head, teacher: LLMConfig, temperature: float):
    """log_softmax(z / T) of one teacher's logits z: its hidden states through its output layer
    `head` (and its final soft-cap), in float32."""
    logits = softcap(hidden @ head, teacher.final_softcap)
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature)


def _routed(logps: dict, batch):
    """Each row's (a packed row: each position's) log-probabilities from the teacher routed to it;
    rows no teacher routes to (padding) keep the first one's, which their mask zeroes."""
    out = None
    for t, logp in logps.items():
        mine = batch[t.row] >= 0
        mine = mine.reshape(mine.shape + (1,) * (logp.ndim - mine.ndim))
        out = logp if out is None else jnp.where(mine, logp, out)
    return out


class TopK(NamedTuple):
    """The teacher's distribution kept to its `k` likeliest tokens at each position: their ids and
    log-probabilities, and the log of the mass left to every other token (the tail)."""

    ids: jax.Array  # [..., k] int32
    log_probs: jax.Array  # [..., k] float32
    log_tail: jax.Array  # [...] float32


def top_k_of(t_logp, k: int) -> TopK:
    """`t_logp`'s `k` likeliest tokens per position and its tail's log-mass; `k` below the
    vocabulary (`distill.top_k` is checked so), so the tail holds at least one token."""
    log_probs, ids = jax.lax.top_k(t_logp, k)
    held = _held(ids, t_logp.shape[-1])
    return TopK(ids, log_probs, jax.nn.logsumexp(jnp.where(held, -jnp.inf, t_logp), axis=-1))


def _held(ids, vocab: int):
    """[..., vocab] booleans: the tokens `ids` [..., k] names."""
    return jnp.any(ids[..., :, None] == jnp.arange(vocab, dtype=ids.dtype), axis=-2)


def sparse_kl(top: TopK, s_logp):
    """KL between the teacher's and the student's distributions coarsened to k + 1 outcomes, the
    teacher's top-k tokens and the rest of the vocabulary as one (MaxText's and DistillKit's
    offline distillation with the "other" bucket): sum_j p_j (log p_j - log q_j) over the top-k, plus
    p_tail (log p_tail - log q_tail). The full KL is this plus p_tail times the KL between the two
    distributions within the tail, so it is never more, and equal where the student spreads its
    tail as the teacher does (a tail of one token); `s_logp` is the student's tempered
    log-probabilities over the vocabulary."""
    s_top = jnp.take_along_axis(s_logp, top.ids, axis=-1)
    s_tail = jax.nn.logsumexp(jnp.where(_held(top.ids, s_logp.shape[-1]), -jnp.inf, s_logp), axis=-1)
    head = jnp.sum(jnp.exp(top.log_probs) * (top.log_probs - s_top), axis=-1)
    return head + jnp.exp(top.log_tail) * (top.log_tail - s_tail)


def distill_loss(s_logits, t_logp, targets, mask, alpha: float, temperature: float, top_k: int | None = None):
    """Summed per-token KD loss over loss-carrying targets, with KL and CE as metrics; `t_logp`
    the teachers' tempered log-probabilities (`teacher_log_probs`), kept to their `top_k` tokens
    and a tail when given (`distill.top_k`: `sparse_kl`), the full vocabulary's KL otherwise; or
    already a `TopK` (a teacher cache's)."""
    s_logp = jax.nn.log_softmax(s_logits.astype(jnp.float32) / temperature)
    if isinstance(t_logp, TopK):
        kl = sparse_kl(t_logp, s_logp)
    elif top_k is None:
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)
    else:
        kl = sparse_kl(top_k_of(t_logp, top_k), s_logp)
    ce = optax.softmax_cross_entropy_with_integer_labels(s_logits.astype(jnp.float32), targets)
    per_token = alpha * temperature**2 * kl + (1.0 - alpha) * ce
    return jnp.sum(per_token * mask), {"kl": jnp.sum(kl * mask), "ce": jnp.sum(ce * mask)}


def head_flops(teachers: tuple[Teacher, ...]) -> float:
    """FLOPs per student token of the teachers' output layers, which run in the student."""
    return sum(2.0 * t.model.width * t.model.vocab for t in teachers)


def student_stages(
    section: Section,
    student: LLMConfig,
    teachers: tuple[Teacher, ...],
    k: int,
    alpha: float,
    temperature: float,
    layers: tuple[int, ...] | None = None,
    routed: bool = False,
    top_k: int | None = None,
    **embed,
):
    """A KD student (`section`) cut into `k` pipeline stages (`layers` blocks each, or evenly):
    the teachers' hidden states and output layers go to the last, which holds the loss; `embed`
    (optional) the first's inputs."""
    return decoder_stages(
        section,
        student,
        k,
        layers=layers,
        finish=lambda module, variables, v, inputs, batch, h: distill_loss(
            module.apply(v, h, method=DecoderLM.logits),
            teacher_log_probs(variables, inputs, batch, teachers, temperature, routed),
            batch["targets"],
            batch["loss_mask"],
            alpha,
            temperature,
            top_k,
        ),
        cost=lambda c, last: llm_cost(c, head=last, extra_flops=head_flops(teachers) if last else 0.0),
        last_keys=tuple(t.head for t in teachers),
        consumes={t.edge: k - 1 for t in teachers},
        **embed,
    )


def init_teacher_and_student(teacher: LLMConfig, student: LLMConfig, key):
    """Teacher body params (frozen) and the student's params plus the teacher's output layer."""
    kt, ks = jax.random.split(key)
    s = DecoderLM(student).init(ks, *_dummy_rows())["params"]
    t, head = init_teacher(teacher, kt)
    return t, s, head


def _dummy_rows():
    return jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4), bool)


def init_teacher(teacher: LLMConfig, key):
    """A teacher's body params (frozen, in its section) and its output layer (in the student's)."""
    t = dict(DecoderLM(teacher).init(key, *_dummy_rows())["params"])
    if teacher.tie_embeddings:
        head = nn.LogicallyPartitioned(t["embedding"].value.T, names=("embed", "vocab"))
    else:
        head = t.pop("lm_head")
    return t, head


def init_teachers(teachers: tuple[Teacher, ...], student: LLMConfig, key):
    """Each teacher's section variables, and the student's params with every teacher's output
    layer. The first teacher takes the key split a one-teacher run always took, so a config of
    one teacher starts from the same weights as before teachers could be several."""
    first, student_params, head = init_teacher_and_student(teachers[0].model, student, key)
    sections = {teachers[0].name: {"params": {}, "consts": {"llm": first}}}
    heads = {teachers[0].head: head}
    for i, t in enumerate(teachers[1:], start=1):
        body, heads[t.head] = init_teacher(t.model, jax.random.fold_in(key, i))
        sections[t.name] = {"params": {}, "consts": {"llm": body}}
    return sections, {"params": student_params, "consts": heads}


def shared_vocab(cfg: Config) -> int:
    """The ids samples must stay inside: every teacher's and the student's embedding tables take
    them, so the vocabularies must be one."""
    return check_vocab(teachers_of(cfg), model(cfg, "student", "llm"))


def refuse_prefix_lm(models: dict[str, LLMConfig], workload: str) -> None:
    """Text rows place no prefix (a PaliGemma language model's image and prompt): a model with
    `prefix_lm` there would run causally, not as it was trained; refused naming it."""
    for name, m in models.items():
        if m.prefix_lm:
            raise ConfigError(
                f"error: models.{name}.prefix_lm=true: {workload}'s text rows for it place no prefix (a PaliGemma "
                f"language model's image and prompt); valid: false, or the model as the LLM of vlm or the student "
                f"of vlm_kd, whose rows place it"
            )


def check_vocab(teachers: tuple[Teacher, ...], student: LLMConfig) -> int:
    """Distillation compares the models' logits token by token: one vocabulary (`teachers_of`
    has held the teachers to the first one's)."""
    t = teachers[0]
    if t.model.vocab != student.vocab:
        raise ConfigError(
            f"error: models.{t.name}.vocab={t.model.vocab}: differs from models.student.vocab={student.vocab} "
            f"(distillation compares their logits token by token); valid: {student.vocab}"
        )
    return student.vocab


def check_top_k(top_k: int | None, vocab: int) -> None:
    """`distill.top_k` keeps fewer tokens than the vocabulary (all of it is the full KL: unset)."""
    if top_k is not None and top_k >= vocab:
        raise ConfigError(
            f"error: distill.top_k={top_k}: keeps the whole vocabulary of {vocab} tokens or more; "
            f"valid: 1 to {vocab - 1}, or unset for the full vocabulary's KL"
        )


def teacher_edges(teachers: tuple[Teacher, ...]) -> tuple[Edge, ...]:
    """Each teacher's hidden states to the student: 2 bytes (bf16) per unit of width."""
    return tuple(Edge(t.edge, t.name, "student", bytes_per_unit=2 * t.model.width) for t in teachers)


def teacher_rows(routes, rows, teachers: tuple[Teacher, ...]) -> dict:
    """The student batch's index of each row into each teacher's outputs."""
    return {t.row: R.route(routes, t.edge, rows) for t in teachers}


def build(cfg: Config) -> SectionGraph:
    if cfg.distill.cache is not None:
        return build_cached(cfg)
    teachers, student, routing = teachers_of(cfg), model(cfg, "student", "llm"), routing_of(cfg)
    refuse_prefix_lm({**{t.name: t.model for t in teachers}, "student": student}, "kd")
    check_top_k(cfg.distill.top_k, check_vocab(teachers, student))
    alpha, temperature, routed = cfg.distill.alpha, cfg.distill.temperature, routing is not None
    top_k = cfg.distill.top_k
    s_model = DecoderLM(student, rows_from_zero=True)  # text_rows' rows
    per_octave = cfg.compile.buckets_per_octave

    def student_batch(rows, routes):
        return {**R.text_rows(rows, per_octave=per_octave), **teacher_rows(routes, rows, teachers)}

    def student_packed_batch(rows, routes, shards, pack):
        edges = {t.edge: R.route(routes, t.edge, rows) for t in teachers}
        return R.packed_text_rows(rows, edges, shards, pack, per_octave=per_octave)

    def student_forward(variables, inputs, batch):
        segments = (batch["segments"], None, batch.get("segment_lengths")) if "segments" in batch else ()
        s_logits, aux = apply_with_losses(
            s_model, {"params": variables["params"]}, batch["input_ids"], batch["positions"], batch["valid"], *segments
        )
        t_logp = teacher_log_probs(variables, inputs, batch, teachers, temperature, routed)
        loss, metrics = distill_loss(s_logits, t_logp, batch["targets"], batch["loss_mask"], alpha, temperature, top_k)
        return loss + aux, metrics

    def init(key):
        sections, student_vars = init_teachers(teachers, student, key)
        return {**sections, "student": student_vars}

    student_section = Section(
        "student",
        trained=True,
        forward=student_forward,
        host_batch=student_batch,
        packed_batch=student_packed_batch,
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(student, head=True, extra_flops=head_flops(teachers)),
        reads=(TOKENS,),
        stages=lambda k, layers=None: student_stages(
            student_section, student, teachers, k, alpha, temperature, layers, routed, top_k
        ),
    )
    return SectionGraph(
        sections=(
            *teacher_sections(teachers, routing, per_octave=per_octave),
            student_section,
        ),
        edges=teacher_edges(teachers),
        init=init,
        loss_count=R.loss_tokens(),
    )


def build_cached(cfg: Config) -> SectionGraph:
    """The student alone, its loss the top-k one over each row's cached teacher outputs
    (`kd_cached`: the cache's checks and the rows' layout)."""
    teacher = kd_cached.one_teacher(cfg, teachers_of(cfg))
    refuse_prefix_lm({"student": model(cfg, "student", "llm")}, "kd")
    check_vocab((teacher,), model(cfg, "student", "llm"))
    kd_cached.check_student_layout(cfg)
    return student_alone(cfg, teacher, kd_cached.checked_manifest(cfg, teacher).identity.k)


def student_alone(cfg: Config, teacher: Teacher, k: int) -> SectionGraph:
    """The KD student without its teacher: its rows carry `teacher`'s top-`k` outputs (a teacher
    cache's), its loss the top-k one; what `simulate` prices against running the teacher online."""
    student = model(cfg, "student", "llm")
    alpha, temperature, per_octave = cfg.distill.alpha, cfg.distill.temperature, cfg.compile.buckets_per_octave
    s_model = DecoderLM(student, rows_from_zero=True)

    def forward(variables, inputs, batch):
        s_logits, aux = apply_with_losses(
            s_model, {"params": variables["params"]}, batch["input_ids"], batch["positions"], batch["valid"]
        )
        top = TopK(*(batch[key] for key in kd_cached.TOP_K_KEYS))
        loss, metrics = distill_loss(s_logits, top, batch["targets"], batch["loss_mask"], alpha, temperature)
        return loss + aux, metrics

    def init(key):  # the online run's student: the same key split, the teacher's share left unused
        _, params, _ = init_teacher_and_student(teacher.model, student, key)
        return {"student": {"params": params, "consts": {}}}

    section = Section(
        "student",
        trained=True,
        forward=forward,
        host_batch=lambda rows, routes: kd_cached.cached_rows(rows, k, per_octave),
        activates=lambda s: True,
        work=R.next_token_units,
        cost=llm_cost(student, head=True),
        reads=(TOKENS, TEACHER_PART),
    )
    return SectionGraph(sections=(section,), edges=(), init=init, loss_count=R.loss_tokens())


def loaders(cfg: Config) -> dict:
    """Every teacher's section and the student start from Hugging Face folders alike (a cached
    teacher has no section)."""
    teachers = () if cfg.distill.cache is not None else teachers_of(cfg)
    return {**{t.name: load_teacher_section for t in teachers}, "student": load_llm_section}


WORKLOAD = Workload("kd", build, vocab=shared_vocab, pretrained=loaders, sample_rule=sample_rule)
