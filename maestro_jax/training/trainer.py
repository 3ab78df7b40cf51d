"""`Trainer`: the Python face of maestro_jax, for a built-in workload or a user's own graph.

    trainer = Trainer(config, graph=my_graph, source=my_source)
    trainer.verify()   # maestro vs the monolithic step on one batch: loss, grads, updated params
    trainer.train()    # `config.steps` optimizer steps; checkpoints, metrics and resume as in the CLI
    trainer.evaluate() # the `eval` block's held-out loss of the run's latest checkpoint, as `maestro-jax eval`
    trainer.bench()    # monolithic vs naive vs wavefront, side by side
    trainer.plan(devices=64, memory_gb=80)   # the planner over this very graph
    trainer.simulate()                       # the config's plan predicted on a cluster

The config gives the plan (`sections`, `edges`), the batch, the optimizer, the schedule and the
run settings; the graph (built-in from `config.workload`, or yours) is checked against it and
every constraint is checked before anything compiles.
"""

from __future__ import annotations

from maestro_jax.config import Config
from maestro_jax.core.graph import SectionGraph
from maestro_jax.runtime.build import build_runtime


class Trainer:
    def __init__(
        self,
        config: Config,
        graph: SectionGraph | None = None,
        source=None,
        check=None,
        eval_source=None,
        modalities: tuple = (),
        vocab: int | None = None,
    ):
        """`source`: any random-access source of `maestro_jax.data.Sample` (`__len__`,
        `__getitem__`; `info(i)` optional). Every sample is validated before it is trained on:
        by `check(sample, parts=None)` (raise DataError; `parts` names the parts this process
        decoded, None: all, the others are zeros), else against the `modalities` your samples
        carry (`maestro_jax.data.Modality`; none: text only) and the `vocab` your embedding
        takes. `eval_source`: held-out samples for the config's `eval` block (a built-in
        workload reads `eval.data`)."""
        self.config = config
        self.eval_source = eval_source
        self.hooks: list = []
        self.runtime = build_runtime(config, graph, source, check, modalities=modalities, vocab=vocab)

    @property
    def graph(self) -> SectionGraph:
        return self.runtime.graph

    def add_hook(self, fn, every: int = 1) -> None:
        """Call `fn(info)` after every `every`-th step of `train`, once that step is read
        (`training.hooks`: `info.step`, `info.record`, the step's metrics)."""
        from maestro_jax.training.hooks import Hook

        self.hooks.append(Hook(fn, every))

    def train(self, progress: bool = True, trackers=()) -> list[dict]:
        """`trackers`: metrics sinks beside the config's (`training.trackers.Tracker`)."""
        from maestro_jax.training.loop import train

        return train(
            self.config, progress, rt=self.runtime, trackers=trackers, eval_source=self.eval_source, hooks=self.hooks
        )

    def evaluate(self, step: int | None = None) -> tuple[int, float]:
        """The held-out loss (the config's `eval` block; a user graph's `eval_source`) of the
        run's checkpoint `step` in `output_dir` (None: the latest committed one), through the
        training plan, as `maestro-jax eval`: returns (step, loss)."""
        from maestro_jax.training.evaluate import evaluate_checkpoint

        return evaluate_checkpoint(self.config, self.runtime, step, source=self.eval_source)

    def verify(self, step: int = 0) -> list:
        """Differences (`tools.verify.Diff`) of loss, every trained section's grads and updated
        params, maestro vs monolithic, on global batch `step`."""
        from maestro_jax.tools.verify import verify

        return verify(self.config, self.runtime, step)

    def bench(self, reps: int = 5, batches: int = 3, trace_dir: str | None = None) -> dict:
        from maestro_jax.tools.bench import bench

        return bench(self.config, reps, batches, trace_dir, rt=self.runtime)

    def plan(self, devices: int, memory_gb: float, top: int = 10):
        """The planner's best plans for this graph (`planning.planner.PlanReport`)."""
        from maestro_jax.tools.plan import planner_for

        return planner_for(self.config, devices, memory_gb, graph=self.graph, source=self.runtime.source).search(top)

    def simulate(self) -> dict:
        from maestro_jax.tools.simulate import simulate_config

        return simulate_config(self.config, graph=self.graph, source=self.runtime.source)
