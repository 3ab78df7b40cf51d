"""What users run today, priced beside the fair monolithic baseline, and the ceiling.

The fair monolithic baseline (`Planner.monolithic_best`) gets everything maestro's sections get
but the sections: the same global length sort, dynamic shape buckets and padding, its best mesh,
micro-batch and checkpointing. Trainers in use today do less, and these prices say how much
less, each on the fair baseline's own layout (mesh, micro-batch, checkpointing, precision) and
cost model, so that only the named difference changes:

- `round_robin`: Megatron-LM's data order. Each micro-batch is the next `micro_batch x dp`
  samples in arrival order, dealt to the data-parallel ranks in contiguous slices
  (`MegatronPretrainingSampler`), no global length sort. Each rank pads its own micro-batch (its
  own shapes, as PyTorch runs them) and runs its micro-batches one after another; the ranks meet
  at the step's gradient reduction, so the step waits for the rank that drew the most work
  (Megatron-Bridge issue 4609: "a DP rank that draws a heavy-image shard stalls the whole group").
- `static_padding`: MaxText's static shapes. Every sample is padded to the most work any sample
  of the priced batches holds in each section (`max_num_images_per_example` images, the longest
  text), and every section runs for every sample (a static program cannot skip its encoder for
  a text-only sample).
- `shared_recipe` (workloads with a frozen section, such as distillation): the frozen sections in
  the trained sections' precision, as a KD recipe that gives the teacher the student's layout
  and precision does (Megatron/ModelOpt). Equal to the fair baseline where they share it already.
- `ceiling`: perfect balance and no padding: every sample's work in every section at its exact
  size, spread evenly over every device, no per-micro-step overhead, plus the optimizer steps.
  No schedule beats it on this cost model; `share` = ceiling time / a plan's time.

Each entry has `step_time_s` and `samples_per_s_per_device`, averaged over the planner's batches
as every other price is. Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from maestro_jax.core.plan import SectionPlan, mesh_shape
from maestro_jax.planning.cluster import cost_model, monolithic_time, packed_time
from maestro_jax.planning.cost import CostModel
from maestro_jax.planning.spec import WorkloadSpec
from maestro_jax.schedule.ops import SampleMeta


def _factor(spec: WorkloadSpec, cost: CostModel, s: str) -> float:
    """A section's work per forward: the sink's loss and gradients, a trained producer's forward
    and backward, a frozen section's forward."""
    c = cost.sections[s]
    if s == spec.sink:
        return c.sink_factor
    return 1.0 + (c.backward_factor if spec.sections[s].trained else 0.0)


def round_robin_time(spec: WorkloadSpec, metas: Sequence, cost: CostModel, mb: int, dp: int) -> float:
    """One batch in Megatron-LM's data order (module docstring): the slowest rank's micro-batches,
    each padded to its own rows, then the optimizer steps."""
    rows = mb * dp
    ranks = [[m for i in range(0, len(metas), rows) for m in metas[i + r * mb : i + (r + 1) * mb]] for r in range(dp)]
    return max(packed_time(spec, mine, cost, mb, mb) for mine in ranks) + sum(cost.update_s.values())


def static_padding_time(
    spec: WorkloadSpec, metas: Sequence, most: Mapping[str, int], cost: CostModel, mb: int, dp: int
) -> float:
    """One batch with every sample padded to `most` (each section's largest work) in every
    section, `mb` rows a shard per micro-step, then the optimizer steps."""
    padded = SampleMeta(frozenset(s for s in spec.sections if most[s]), dict(most))
    return packed_time(spec, [padded] * len(metas), cost, mb, mb * dp) + sum(cost.update_s.values())


def ceiling_time(spec: WorkloadSpec, metas: Sequence, cost: CostModel, dp: int) -> float:
    """One batch at the ceiling (module docstring): each sample's exact work, no overheads, on
    every device at once."""
    total = 0.0
    for s in spec.sections:
        c = cost.sections[s]
        work = sum(c.per_unit_s * u + c.per_unit2_s * u * u for u in (m.work.get(s, 0) for m in metas))
        total += work * _factor(spec, cost, s) / dp
    return total + sum(cost.update_s.values())


def user_baselines(
    spec: WorkloadSpec,
    metas_all: Sequence[Sequence],
    layout: Mapping,
    devices: int,
    global_batch: int,
    device: str,
    link_gbps: float,
    typical: Mapping[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """`round_robin`, `static_padding`, `shared_recipe` (with a frozen section) and `ceiling` on
    the fair monolithic baseline's `layout` (`Planner.monolithic_best`: mesh, micro-batch,
    checkpointing by section) over all `devices`, each as {step_time_s, samples_per_s_per_device}."""
    sp = SectionPlan(tuple(range(devices)), mesh_shape(**layout["mesh"]), layout["micro_batch"])
    plans = {
        s: dataclasses.replace(sp, precision=sec.precision, layer_remat=layout["layer_remat"][s])
        for s, sec in spec.sections.items()
    }
    cost = cost_model(spec, plans, metas_all, device, link_gbps, typical, packed=False)
    mb, dp = sp.micro_batch, sp.dp
    most = {s: max(m.work.get(s, 0) for metas in metas_all for m in metas) for s in spec.sections}
    times = {
        "round_robin": statistics.mean(round_robin_time(spec, m, cost, mb, dp) for m in metas_all),
        "static_padding": statistics.mean(static_padding_time(spec, m, most, cost, mb, dp) for m in metas_all),
    }
    frozen = [s for s in spec.order if not spec.sections[s].trained]
    if frozen:
        precision = spec.sections[spec.sink].precision
        shared = {s: dataclasses.replace(p, precision=precision) if s in frozen else p for s, p in plans.items()}
        shared_cost = cost_model(spec, shared, metas_all, device, link_gbps, typical, packed=False)
        times["shared_recipe"] = statistics.mean(monolithic_time(spec, m, shared_cost, mb, sp.rows) for m in metas_all)
    times["ceiling"] = statistics.mean(ceiling_time(spec, m, cost, dp) for m in metas_all)
    return {k: {"step_time_s": t, "samples_per_s_per_device": global_batch / t / devices} for k, t in times.items()}
