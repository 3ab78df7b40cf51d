"""Planner: choose each section's devices, mesh, micro-batch and residual policy.

Plain Python, no JAX. 0.3.0's front door to the planning half, kept for its callers: a
`Planner` holds one `PlanningProblem` (`planning/problem.py`), its `Pricer` (`pricer.py`: memory,
section costs and bounds, step and device time) and its plan space (`space.py`: the placements of
the sections into device groups and every plan under a bound, from each section's options in
`options.py`, bounded by `bounds.py`), and searches it with `search.search` (`search.py`: branch and
bound, exact up to a stated gap), the baselines priced beside (`baselines.py`, their layouts as
plans in `points.py`). New code calls `search(problem)` directly.

Memory per device and the layouts a section can take: `planning/layout.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from maestro_jax.core.plan import Plan
from maestro_jax.planning.baselines import monolithic_best
from maestro_jax.planning.bounds import Option
from maestro_jax.planning.cost import DEVICES
from maestro_jax.planning.points import pipelined_point
from maestro_jax.planning.pricer import Pricer
from maestro_jax.planning.problem import PlanningProblem
from maestro_jax.planning.report import Candidate, InfeasibleError, PlanReport, format_table  # noqa: F401 - their old home
from maestro_jax.planning.search import TIE, TOLERANCE, best_plans, infeasible_message, search, spent
from maestro_jax.planning.simulator import DEVICE_TIME  # noqa: F401 - its old home (tools)
from maestro_jax.planning.space import Limit, PlanSpace
from maestro_jax.planning.spec import SPLIT_COUNTS, WorkloadSpec
from maestro_jax.planning.text import layer_remat_text  # noqa: F401 - its old home (cli, plug-ins)

# pipeline stage counts `plan --stages` tries for a section that splits (`WorkloadSpec.splits`): the
# first three of the counts it is cut into (`spec.SPLIT_COUNTS`, which a config's own count of 16
# stages is checked with)
STAGE_COUNTS = SPLIT_COUNTS[:3]


class Planner:
    """Search over plans of a workload (any section DAG) on `devices` devices with `memory_gb` each.

    Each section's options are enumerated on their own (device count, tensor degree,
    data-parallel degree, micro-batch, residual policy, per-layer activation checkpointing for
    trained sections, context and expert degrees where the section has attention or experts);
    the fsdp degree is the smallest that fits the memory budget, since fsdp costs communication
    (priced per micro-step). A plan puts the sections into device groups (`placements`): a group
    is a contiguous device range, all devices are used, and the sections of one group share its
    devices, each with its own layout, their memory adding up (the all-in-one group with one
    layout for every section is the monolithic layout's point in this space). An edge joins any
    data-parallel degrees (fan-out, fan-in, uneven). Candidates are scored with the
    wavefront scheduler and the simulator, which runs a group's sections one at a time.
    `problem` (`planning.problem.PlanningProblem`): the workload, batches, devices, budget and
    search space (its `stage_counts`: the pipeline stage counts a section that splits may also
    take; `plan --stages` gives `STAGE_COUNTS`, none by default); a planner with other settings
    (`_with`, `_of`) is one of `problem.replace(...)`. `tolerance`: the relative gap to the
    optimum the search may leave (module docstring). `progress`, when given, receives one line
    per pass of the search (`search` runs one per stash bound and run-ahead setting) and one
    before the baselines.
    """

    def __init__(
        self,
        problem: PlanningProblem | WorkloadSpec,
        metas: Sequence | None = None,
        devices: int | None = None,
        memory_gb: float | None = None,
        *,
        tolerance: float = TOLERANCE,
        progress: Callable[[str], None] | None = None,
        pricer: Pricer | None = None,
        space: PlanSpace | None = None,
        **settings,
    ):
        """`Planner(problem)`; 0.3.0's form, `Planner(spec, metas, devices, memory_gb,
        global_batch=..., ...)` with `PlanningProblem`'s fields as keywords, builds the problem.
        `pricer`: the problem's (`Pricer.for_problem` of another's keeps the prices it can);
        `space`: the pricer's plan space (`PlanSpace.with_problem` of another's shares its options)."""
        if not isinstance(problem, PlanningProblem):
            problem = PlanningProblem.of(problem, metas, devices, memory_gb, **settings)
        elif metas is not None or devices is not None or memory_gb is not None or settings:
            raise TypeError("Planner(problem) takes the problem alone (change it with problem.replace)")
        if pricer is not None and pricer.problem is not problem:
            raise ValueError("Planner(problem, pricer=...): the pricer prices another problem")
        self.problem = problem
        self.pricer = pricer or Pricer(problem)
        self.progress = progress or (lambda line: None)
        self.tolerance = max(tolerance, TIE)
        self._settings(problem)
        self.space = space or PlanSpace(self.pricer)
        self.sections, self.bounds = self.space.sections, self.space.bounds
        self._ahead, self._ahead_edges = self.pricer.ahead, self.pricer.ahead_edges
        self._paths = self.bounds.paths

    def _settings(self, problem: PlanningProblem) -> None:
        """The problem's fields as the planner reads them."""
        self.spec, self.metas, self.devices, self.budget = (
            problem.spec,
            list(problem.metas),
            problem.devices,
            problem.budget_bytes,
        )
        self.run_ahead, self.balance_shards = problem.run_ahead, problem.balance_shards
        self.global_batch, self.device, self.link_gbps = problem.global_batch, problem.device, problem.link_gbps
        self.max_in_flight, self.residuals, self.layer_remat = (
            problem.max_in_flight,
            problem.residuals,
            problem.layer_remat,
        )
        self.contexts = problem.contexts
        self.stage_counts = problem.stage_counts
        self.serial = DEVICES[problem.device].get("serial", False)

    @property
    def max_units(self) -> dict[str, int]:
        """Each section's most work units in any planning sample (`Pricer.max_units`)."""
        return self.pricer.max_units

    @property
    def typical_units(self) -> dict[str, float]:
        """Each section's typical work units a sample (`Pricer.typical_units`)."""
        return self.pricer.typical_units

    def options(
        self, section: str, n: int, budget: float | None = None, lightest: bool = False, alone: bool = True
    ) -> list[Option]:
        """`section`'s options on `n` devices (`options.SectionOptions.options`)."""
        return self.sections.options(section, n, budget, lightest, alone)

    def placements(self) -> list[tuple[tuple[str, ...], ...]]:
        """Every way to put the sections into device groups (`space.PlanSpace.placements`)."""
        return self.space.placements()

    def candidates(
        self, budget: float | None = None, lightest: bool = False, threshold: float | Limit = math.inf
    ) -> Iterator[tuple[Plan, dict, float]]:
        """(plan, memory by section, lower bound) of every plan under `threshold`
        (`space.PlanSpace.candidates`)."""
        return self.space.candidates(budget, lightest, threshold)

    # -- prices (the pricer's; kept here for the callers of 0.3.0) ------------------------------
    def check(self, plan: Plan) -> dict[str, dict[str, float]]:
        """The runtime's constraint checks on a whole plan (`Pricer.check`); raises PlanError."""
        return self.pricer.check(plan)

    def step_time(self, plan: Plan) -> float:
        """`plan`'s simulated step time (`Pricer.step_time`)."""
        return self.pricer.step_time(plan)

    def device_time(self, plan: Plan) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Where `plan`'s device time goes (`Pricer.device_time`)."""
        return self.pricer.device_time(plan)

    def _stage_counts(self, plan: Plan) -> dict[str, int]:
        return self.pricer.stage_counts(plan)

    # -- search (`planning.search`) -------------------------------------------------------------
    def search(self, top: int = 10) -> PlanReport:
        """The best plan and the `top` runners-up by simulated step time (`search.search`)."""
        return search(self.problem, top=top, tolerance=self.tolerance, progress=self.progress, space=self.space)

    def _spent(self, c: Candidate) -> tuple[dict, dict]:
        """Where candidate `c`'s device time goes, priced as it was scored (`search.spent`)."""
        return spent(self.pricer, c)

    def _pipelined_point(self, pipelined: dict | None) -> Candidate | None:
        """The pipelined baseline's layout scored as a maestro plan (`points.pipelined_point`)."""
        return pipelined_point(self.pricer, pipelined)

    def _of(self, spec: WorkloadSpec, metas: Sequence) -> Planner:
        """A planner of `spec` (this workload staged or cut otherwise) on `metas`, with this one's
        devices, budget, pricing and search settings, no stage search and no run-ahead."""
        return Planner(
            self.problem.replace(spec=spec, metas=tuple(metas), run_ahead=0, stage_counts=()),
            tolerance=self.tolerance,
        )

    def _search(self, top: int, incumbent: float = math.inf) -> tuple[list[Candidate], int, int]:
        """The `top` best plans at this planner's stash bound (`search.best_plans`)."""
        return best_plans(self.space, top, incumbent, self.tolerance, self.progress)

    def monolithic_best(self) -> dict | None:
        """The fair monolithic baseline's best layout on this planner's devices
        (`baselines.monolithic_best`)."""
        self.progress(f"baselines on {self.devices} devices: the monolithic layout and the pipelined (1F1B) one")
        return monolithic_best(self.pricer)

    def _with(self, devices: int, max_in_flight: int | None = None, run_ahead: int | None = None) -> Planner:
        """This planner with other settings; the layouts' costs and weights, which none of them
        change, are shared (`space.PlanSpace.with_problem`)."""
        problem = self.problem.replace(
            devices=devices,
            max_in_flight=max_in_flight or self.max_in_flight,
            run_ahead=self.run_ahead if run_ahead is None else run_ahead,
        )
        space = self.space.with_problem(problem)
        return Planner(problem, tolerance=self.tolerance, progress=self.progress, pricer=space.pricer, space=space)

    def _infeasible_message(self) -> str:
        return infeasible_message(self.space)
