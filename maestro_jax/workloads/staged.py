"""Pipeline stages of the built-in decoder sections (`Section.stages`; `core.stages`).

A decoder section (a VLM's `llm`, a KD `student` or `teacher`) cut into K stages: each stage a
`DecoderLM` holding a consecutive run of blocks (`core.stages.layer_ranges`: an even cut, or the
config's `stage_layers`); the first also the
embedding and whatever comes before the blocks (a VLM's image embeddings spliced in, and the
DeepStack features of a Qwen3-VL language model: its first stage must hold every block that adds
them, as the image features reach the first stage only), the last
the final norm, the output layer and the loss (or, for a KD teacher, the hidden states it sends).
Every stage reads its rows' token layout from the section's own `host_batch` (positions, masks,
targets) and the previous stage's activations from the stage edge, so a stage's rows need not
line up with its neighbour's: the edge routes them as any edge does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping

import jax.numpy as jnp

from maestro_jax.core.graph import Section, UnitCost
from maestro_jax.core.stages import StageSplit, layer_ranges, stage_aux_edge, stage_edge, stage_name
from maestro_jax.models import DecoderLM, LLMConfig, apply_with_row_losses
from maestro_jax.workloads import rows as R

# (module, v, inputs, batch) -> (x_BLD, deepstack_JBLD or None): stage 0's input embeddings and the
# DeepStack features its blocks add (`DecoderLM.body`)
Embed = Callable
Finish = Callable  # (module, variables, v, inputs, batch, h_BLD) -> the section's forward output


def token_embeddings(module: DecoderLM, v, inputs, batch):
    """The plain input embeddings of the rows' token ids (no DeepStack features)."""
    return module.apply(v, batch["input_ids"], method=DecoderLM.embed), None


def decoder_stages(
    section: Section,
    llm: LLMConfig,
    k: int,
    *,
    finish: Finish,
    cost: Callable[[LLMConfig, bool], UnitCost],
    embed: Embed = token_embeddings,
    at: tuple[str, ...] = ("params",),
    last_keys: tuple[str, ...] = (),
    consumes: Mapping[str, int] | None = None,
    with_head: bool = True,
    layers: tuple[int, ...] | None = None,
) -> StageSplit:
    """`section` (a decoder of config `llm`) cut into `k` stages.

    finish: the last stage's output from the final-normed hidden states (the loss and its metrics
      for a sink, `{edge: h}` for a teacher); embed: stage 0's input embeddings. at: where the
      decoder's parameters sit in the section's variables (a frozen teacher's under consts/llm).
    last_keys: other variables the last stage holds (a KD student's `teacher_head`); consumes: the
      section's input edges the last stage reads (edge -> stage). cost(stage config, is last): a
      stage's `UnitCost` (the stage config's depth is its block count). layers: each stage's block
      count (`sections.<s>.stage_layers`), default as even as they come (`core.stages.layer_ranges`).
    ValueError naming the model setting when the decoder cannot be staged."""
    _check_stageable(section, llm, k, layers, with_head)
    ranges = layer_ranges(llm.depth, k, layers)
    _check_deepstack(llm, ranges)
    # an MoE balance loss: each stage's rows' terms travel on with the rows to the last stage
    aux = bool(llm.experts and llm.router_aux_loss and section.trained)
    body = _StageBody(llm, with_head, at, embed, finish, aux)
    return StageSplit(
        sections=tuple(body.section(section, ranges, i, cost) for i in range(k)),
        owner=functools.partial(_owner, ranges, (*_LAST, *last_keys)),
        consumes=dict(consumes or {}),
        bytes_per_unit=2 * llm.width,
        # a stage runs its neighbour's micro-steps (the same rows, so the same bucket): the next
        # stage takes the hidden states' position slices as they arrive (`mj.rows.gather`)
        positions_per_unit=1.0,
        aux=aux,
    )


def _check_stageable(section: Section, llm: LLMConfig, k: int, layers, with_head: bool) -> None:
    """A ValueError naming the setting where the decoder cannot be cut into `k` stages."""
    if llm.scan_layers:
        raise ValueError(
            "the model's layers are scanned (scan_layers: true); a stage holds a run of unrolled layers; valid: 1, "
            "or the model with scan_layers: false"
        )
    if layers is None and not 1 <= k <= llm.depth:
        raise ValueError(f"the model has {llm.depth} layers; valid: 1 to {llm.depth}")
    if with_head and llm.tie_embeddings and section.trained:
        raise ValueError(
            "the model ties its output layer to its embedding (tie_embeddings: true), which the first and the "
            "last stage would both train; valid: 1"
        )


def _check_deepstack(llm: LLMConfig, ranges) -> None:
    """Only the first stage receives the image features: it holds every DeepStack block."""
    if llm.deepstack_layers > ranges[0][1]:
        raise ValueError(
            f"the model adds DeepStack image features in blocks 0..{llm.deepstack_layers - 1} (deepstack_layers: "
            f"{llm.deepstack_layers}) and the first stage, which alone receives the images, holds "
            f"{ranges[0][1]} blocks; valid: a first stage of at least {llm.deepstack_layers} blocks (stage_layers)"
        )


_LAST = ("final_norm", "lm_head")  # the last stage's parameters besides the blocks (and `last_keys`)


def _owner(ranges, last: tuple[str, ...], path: tuple[str, ...]) -> int | None:
    """The stage that holds the parameter at `path`: the embedding the first, the final norm, the
    output layer and `last` the last, a block the stage whose range holds it; None for others."""
    for key in path:
        if key == "embedding":
            return 0
        if key in last:
            return len(ranges) - 1
        block = re.fullmatch(r"block_(\d+)", key)
        if block:
            return next(i for i, (a, b) in enumerate(ranges) if a <= int(block[1]) < b)
    return None


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as a function is
class _StageBody:
    """What every stage of one decoder shares: its config, whether it has an output layer, where
    its parameters sit (`at`), the first stage's embedding, the last stage's `finish` and whether
    MoE balance terms travel with the rows (`aux`)."""

    llm: LLMConfig
    with_head: bool
    at: tuple[str, ...]
    embed: Embed
    finish: Finish
    aux: bool

    def section(self, section: Section, ranges, i: int, cost: Callable[[LLMConfig, bool], UnitCost]) -> Section:
        """Stage i of `section` as a section of its own, priced by `cost` on its blocks."""
        run = self.stage(section.name, ranges, i)
        return Section(
            stage_name(section.name, i),
            trained=section.trained,
            forward=run.forward,
            host_batch=functools.partial(run.host_batch, section.host_batch),
            activates=section.activates,
            work=section.work,
            cost=cost(dataclasses.replace(self.llm, depth=ranges[i][1] - ranges[i][0]), i == len(ranges) - 1),
            reads=section.reads,
        )

    def stage(self, name: str, ranges, i: int) -> _Stage:
        k = len(ranges)
        module = DecoderLM(
            self.llm, with_head=self.with_head, layers=ranges[i], first=i == 0, last=i == k - 1, rows_from_zero=True
        )
        return _Stage(
            self,
            module,
            prev=stage_edge(name, i - 1) if i else None,
            out=stage_edge(name, i) if i < k - 1 else None,
            prev_aux=stage_aux_edge(name, i - 1) if i else None,
            out_aux=stage_aux_edge(name, i) if i < k - 1 else None,
        )


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as a function is
class _Stage:
    """Stage i of a decoder: its `DecoderLM` over its blocks, the stage edges it reads (`prev`,
    `prev_aux`; none for the first) and writes (`out`, `out_aux`; none for the last)."""

    body: _StageBody
    module: DecoderLM
    prev: str | None
    out: str | None
    prev_aux: str | None
    out_aux: str | None

    def host_batch(self, section_batch, rows, routes):
        """The section's own batch of the rows, and where each row's activations sit on `prev`."""
        batch = section_batch(rows, routes)
        return batch if self.prev is None else {**batch, f"{self.prev}_row": R.route(routes, self.prev, rows)}

    def forward(self, variables, inputs, batch):
        b, module, prev, out = self.body, self.module, self.prev, self.out
        v = variables
        for key in b.at:
            v = v[key]
        v = {"params": v}
        if prev is None:
            x, deepstack = b.embed(module, v, inputs, batch)
        else:
            x = R.gather(inputs, prev, batch[f"{prev}_row"], length=batch["input_ids"].shape[1])
            deepstack = None  # every DeepStack block sits in the first stage (checked above)
        body = (batch["positions"], batch["valid"], None, batch.get("images"), deepstack)
        if not b.aux:
            h = module.apply(v, x, *body, method=DecoderLM.body)
            if out is not None:
                return {out: h}
            return b.finish(module, variables, v, inputs, batch, module.apply(v, h, method=DecoderLM.final))
        h, terms = apply_with_row_losses(module, v, x, *body, method=DecoderLM.body)
        if prev is not None:  # the stages' before it, of the same rows (none on a padding row)
            row = batch[f"{prev}_row"]
            terms = terms + R.gather(inputs, self.prev_aux, row, length=1)[:, 0] * (row >= 0)
        if out is not None:
            return {out: h, self.out_aux: terms[:, None]}
        loss, metrics = b.finish(module, variables, v, inputs, batch, module.apply(v, h, method=DecoderLM.final))
        return loss + jnp.sum(terms), metrics
