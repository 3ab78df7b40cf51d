"""Held-out loss through the training plan: the same sections, meshes and schedule.

The `eval` block names a data source and how many global batches of it count. They are read,
checked, scheduled and packed once, in order, so every evaluation sees the same samples and
its losses compare across steps. The loss is the mean over every loss-carrying token of those
batches (each batch's mean weighted by its token count), the training loss's normalisation.
`issue` queues the work behind the step's update and returns at once; `read` waits. The batches
run forward only (`SectionedStep.evaluate`: each producer's forward, the sink's loss; no residuals,
no gradients), and their programs are compiled with the training step's (`samples`).
"""

from __future__ import annotations

import logging

from maestro_jax.config import Config, ConfigError, EvalConfig
from maestro_jax.data.pipeline import first_batches
from maestro_jax.runtime.build import Runtime
from maestro_jax.runtime.step import StepBatch, TrainState

log = logging.getLogger("maestro_jax")


class Evaluation:
    def __init__(self, rt: Runtime, source, batches: int, skip: bool = False):
        """`skip`: the eval data's `on_bad_sample` is `skip`, so a bad sample is left out (counted
        in `skipped`, said once) and the batch takes the next good one."""
        data, self.skipped = first_batches(source, rt.cfg.global_batch, batches, rt.check, skip)
        if len(data) < batches:
            good = "" if not self.skipped else f" of good samples ({len(self.skipped)} bad ones skipped)"
            raise ConfigError(
                f"error: eval.batches={batches}: the eval data holds {len(data)} global batches{good} of "
                f"{rt.cfg.global_batch}; valid: at most {len(data)}"
            )
        if self.skipped:
            log.warning(
                "eval: %d bad sample(s) skipped (on_bad_sample=skip), the first: %s", len(self.skipped), self.skipped[0]
            )
        self.rt, self.batches = rt, []
        for i in range(batches):
            samples = data[i]
            schedule = rt.schedule(samples)
            host = rt.executor.host_batches(samples, schedule)
            self.batches.append(StepBatch(samples, schedule, rt.graph.loss_count(samples), host))

    @property
    def samples(self) -> list[list]:
        """The evaluated global batches' samples (what `SectionedStep.compile(evaluate=)` takes)."""
        return [b.samples for b in self.batches]

    def issue(self, state: TrainState) -> list:
        """Each batch's loss as a device scalar, queued on the devices; nothing is waited for."""
        return [(self.rt.step.evaluate(state, b), b.loss_count) for b in self.batches]

    def read(self, issued: list) -> float:
        """The token-weighted mean of the batches' losses (waits for the devices)."""
        total = sum(tokens for _, tokens in issued)
        return sum(float(self.rt.coordinator.fetch(loss)) * tokens for loss, tokens in issued) / max(total, 1)


def held_out_source(cfg: Config):
    """The `eval` block's samples from the config: `eval.data` (its errors name `eval.data`), or
    the training data's settings drawn with `seed + 1`. Built before anything compiles, so a
    missing file is refused first."""
    from maestro_jax import workloads

    if cfg.workload is None:
        raise ConfigError("error: eval: a user graph evaluates on its own source; pass eval_source to Trainer")
    held_out = cfg.model_copy(update={"data": cfg.eval.data or cfg.data, "seed": cfg.seed + 1})
    return workloads.source_from_config(held_out, "eval.data" if cfg.eval.data is not None else "data")


def evaluation_for(cfg: Config, rt: Runtime, source=None) -> Evaluation | None:
    """The run's `Evaluation`, or None without an `eval` block. `source`: a user graph's own eval
    source; else the config's `eval.data` (synthetic with `seed + 1`)."""
    if cfg.eval is None:
        return None
    source = source if source is not None else held_out_source(cfg)
    skip = (cfg.eval.data or cfg.data).on_bad_sample == "skip"
    return Evaluation(rt, source, cfg.eval.batches, skip)


def evaluate_checkpoint(cfg: Config, rt: Runtime, step: int | None = None, source=None) -> tuple[int, float]:
    """`maestro-jax eval` and `Trainer.evaluate`: the eval loss of the config's checkpoint `step`
    (None: the latest committed one), read under the run's lock
    (`training.checkpoint.reading_checkpoints`); `source` as `evaluation_for`'s. Returns (step, loss).
    A config without an eval block takes the block's defaults (`EvalConfig`: 2 batches of the
    training data's synthetic settings drawn with seed + 1), so the command runs on any config
    whose data is synthetic or that names eval.data."""
    from maestro_jax.training.checkpoint import reading_checkpoints

    if cfg.eval is None:
        if source is None and cfg.data.kind != "synthetic":
            raise ConfigError(
                f"error: eval.data: not set (the config has no eval block), and the training data (data.kind="
                f"{cfg.data.kind}) is no held-out source; give eval.data (e.g. kind: array_record with other paths)"
            )
        cfg = cfg.model_copy(update={"eval": EvalConfig()})
    evaluation = evaluation_for(cfg, rt, source)
    if not cfg.output_dir:
        raise ConfigError("error: output_dir: not set; name the run whose checkpoint to evaluate")
    with reading_checkpoints(cfg, rt.coordinator) as ckpt:
        steps = ckpt.committed_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ConfigError(f"error: --step={step}: {ckpt.directory} holds checkpoints of steps {steps or 'none'}")
        fresh = rt.step.init()
        state = TrainState(
            step, rt.stage_states(ckpt.restore(step, rt.whole_states(fresh.sections))[0], fresh.sections)
        )
    return step, evaluation.read(evaluation.issue(state))
