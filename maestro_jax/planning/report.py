"""What a search reports: its candidates (a plan with its predicted time and memory), the best
and runners-up with every baseline beside them, the table `plan` prints and the JSON it writes.
Plain values, no JAX; `search.search` builds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from maestro_jax.core.plan import Plan
from maestro_jax.planning.baselines import BaselineResult, baselines_json


class InfeasibleError(ValueError):
    """No plan fits the request; the message says the smallest request that would."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: Plan
    step_time_s: float
    samples_per_s_per_device: float
    memory_gb: dict[str, float]  # peak per device, by section
    max_in_flight: int  # the stash bound it was scored with (`schedule.max_in_flight`)
    peak_gb: float  # per device of the fullest device group (co-located sections add up)
    run_ahead: int = 0  # whether frozen sections compute the next batch during the step (`schedule.run_ahead`)
    stages: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # section -> its stages
    # section -> its layers by stage, where not the even cut (`sections.<s>.stage_layers`)
    cuts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict:
        return {
            s: {
                "devices": f"{sp.devices[0]}:{sp.devices[-1] + 1}",
                "mesh": dict(sp.axis_sizes),
                "micro_batch": sp.micro_batch,
                "residuals": sp.residuals,
                "layer_remat": sp.layer_remat,
            }
            for s, sp in self.plan.sections.items()
        }


@dataclasses.dataclass(frozen=True)
class PlanReport:
    best: Candidate
    top: list[Candidate]
    considered: int  # candidate plans that pass every constraint
    simulated: int  # that the bound did not rule out
    # every baseline of `planning.baselines.BASELINES` on the same devices, by name (None: no layout
    # fits): the fair monolithic, the 1F1B pipeline (Megatron-LM's), what users run today on the
    # fair monolithic layout, and the ceiling; `baseline_lines` and `baselines_json` render them
    baselines: Mapping[str, BaselineResult | None]
    # where the best plan's device time goes (`Planner.device_time`: shares of DEVICE_TIME), in all
    # and by section
    device_time: dict | None = None
    section_time: dict | None = None

    # the records of 0.3.0's fields, for callers that read them by key (`plan --json` writes them)
    @property
    def monolithic(self) -> dict | None:
        return baselines_json(self.baselines)["monolithic"]

    @property
    def pipelined(self) -> dict | None:
        return baselines_json(self.baselines)["pipelined"]

    @property
    def user_baselines(self) -> dict | None:
        return baselines_json(self.baselines)["user_baselines"]

    def to_json(self) -> dict:
        """The report as `plan --json` writes it: the best plan (its layers by stage where not the
        even cut), its time and rate, the runners-up, every baseline (`baselines_json`), where the
        best plan's device time goes, and how many plans were considered and simulated."""
        best = self.best
        return {
            "best": best.describe(),
            "stage_layers": {s: list(c) for s, c in best.cuts.items()},
            "step_time_s": best.step_time_s,
            "samples_per_s_per_device": best.samples_per_s_per_device,
            "top": [{"plan": c.describe(), "step_time_s": c.step_time_s, "memory_gb": c.memory_gb} for c in self.top],
            **baselines_json(self.baselines),
            "device_time": self.device_time,
            "device_time_by_section": self.section_time,
            "considered": self.considered,
            "simulated": self.simulated,
        }


def format_table(report: PlanReport, rows: Sequence[Candidate] | None = None) -> str:
    lines = [
        (
            f"{'#':>2s}  {'step s':>10s}  {'samples/s/dev':>13s}  plan (devices mesh[data,fsdp,expert,context,tensor] "
            f"micro-batch residuals layer-remat; fanouts; stash bound)  GB/device by section (co-located: they share)"
        )
    ]
    for i, c in enumerate(rows or report.top):
        parts = [
            f"{s} {d['devices']} [{','.join(str(n) for n in d['mesh'].values())}] "
            f"mb{d['micro_batch']}{' remat' if d['residuals'] == 'remat' else ''}"
            f"{'' if d['layer_remat'] == 'none' else ' layers:' + d['layer_remat']}"
            for s, d in c.describe().items()
        ]
        fan = ",".join(f"{e}={f}" for e, f in c.plan.fanout.items()) or "-"  # whole ones; the rest uneven
        mem = " ".join(f"{s}={g:.3g}" for s, g in c.memory_gb.items())
        cuts = "".join(f"; {s} layers {'/'.join(map(str, n))}" for s, n in c.cuts.items())
        lines.append(
            f"{i + 1:2d}  {c.step_time_s:10.4g}  {c.samples_per_s_per_device:13.4g}  "
            f"{' | '.join(parts)}; fanouts {fan}{cuts}; in flight {c.max_in_flight}"
            f"{'; run ahead' if c.run_ahead else ''}  {mem}"
        )
    return "\n".join(lines)
