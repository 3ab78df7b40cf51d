"""One optimizer step, issued without waiting and read later: what the training loop
(`training.loop`), `verify`-style scripts and tests call to train on a batch.

`issue_step` enqueues a step's programs, transfers and update and returns at once with an
`IssuedStep`; `IssuedStep.read` is the host's one wait on the devices in a step (the loss, the
finiteness flags, the gradient norms and learning rates). `train_step` is both at once.
"""

from __future__ import annotations

import math
import time

import numpy as np

from maestro_jax.runtime.optimizer import current_rate


class NonFiniteError(RuntimeError):
    """NaN or inf in the loss or a section's gradients, with `on_nonfinite: stop`."""


class IssuedStep:
    """One optimizer step issued to the devices whose results the host has not read yet.

    Reading the loss and the per-section finiteness flags (`read`) is the host's one wait on the
    devices in a step. The record holds the loss, each trained section's gradient norm
    (`grad_norm/<section>`) and learning rate (`lr/<section>`), and each metric the sink returns
    (`<sink>/<metric>`: KD's `kl` and `ce`), summed over the batch and divided by the loss's
    normaliser as the loss is (per loss-carrying token). The loop reads step N only after issuing step N+1, so the devices are
    never idle while the host dispatches; it reads at once only where the next action needs the
    result (a checkpoint, the last step, a preemption, `on_nonfinite: skip`), and the record's
    `wait_reason` says which."""

    def __init__(
        self,
        step: int,
        loss,
        finite: dict,
        sink: str,
        on_nonfinite: str,
        record: dict,
        norms_sq: dict | None = None,
        fetch=np.asarray,
        metrics: dict | None = None,
        norm: float = 1.0,
    ):
        self.step, self.loss, self.finite, self.sink, self.on_nonfinite = step, loss, finite, sink, on_nonfinite
        self.fetch = fetch  # a device value on this host (`Coordinator.fetch`: held by another process too)
        self.record = record
        self.norms_sq = norms_sq or {}  # each trained section's squared grad norm, a device scalar
        self.metrics = metrics or {}  # the sink's metrics summed over the batch, device scalars
        self.norm = norm  # the batch's loss normaliser (its loss-carrying tokens): the metrics are read per unit of it
        self.rates: dict = {}  # each trained section's learning rate in the update, once it is issued
        self.evaluated: list = []  # the held-out losses issued after this step (`Evaluation.issue`)
        self.was_read = False

    def read(self) -> dict:
        """The step's metrics record (waiting for the devices); raises `NonFiniteError` for a
        non-finite step under `on_nonfinite: stop`, else marks it `skipped_nonfinite`."""
        if self.was_read:
            return self.record
        t0 = time.perf_counter()
        fetch = self.fetch
        loss = float(fetch(self.loss))  # the host waits for the devices here
        bad = sorted(s for s, ok in self.finite.items() if not bool(fetch(ok)))
        norms = {s: float(fetch(n)[0]) for s, n in sorted(self.norms_sq.items())}
        rates = {s: float(fetch(r)) for s, r in sorted(self.rates.items())}
        metrics = {f"{self.sink}/{k}": float(fetch(v)) / self.norm for k, v in sorted(self.metrics.items())}
        self.was_read = True
        self.record.update(loss=loss, device_wait_s=time.perf_counter() - t0)
        self.record.update(metrics)
        if norms:  # the norm clipping reads (before clipping), over all sections and per section
            self.record["grad_norm"] = math.sqrt(sum(norms.values()))
            self.record.update({f"grad_norm/{s}": math.sqrt(v) for s, v in norms.items()})
        self.record.update({f"lr/{s}": v for s, v in rates.items()})
        if not math.isfinite(loss):
            bad = [f"{self.sink} (loss)"] + [b for b in bad if b != self.sink]
        if bad:
            msg = f"step {self.step}: non-finite loss or gradients in section(s) {', '.join(bad)}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(msg + " (on_nonfinite=stop; set on_nonfinite=skip to skip such steps)")
            self.record["skipped_nonfinite"] = bad
        return self.record


def issue_step(
    rt,
    states,
    samples,
    step: int,
    on_nonfinite: str = "stop",
    schedule=None,
    norm: int | None = None,
    host: dict | None = None,
    ahead=None,
):
    """Issue one optimizer step without waiting for it: returns the new states and its `IssuedStep`.

    NaN/inf in the loss or a section's gradients is detected per section when the step is read.
    Under `on_nonfinite="stop"` the update is issued at once: a non-finite step stops the run when
    it is read, before anything after it is saved (a checkpoint step is read before its save).
    Under `"skip"` the update depends on the check, so the step is read before the update is
    issued, and a bad step leaves every section's params and optimizer state untouched.
    `schedule` and `norm` come with a `LoadedBatch` (whose samples may be partly hollow), `host`
    with a `PreparedBatch` (the micro-steps' inputs, packed ahead), `ahead` with run-ahead (the
    batch's frozen forwards, issued during the step before: `Executor.run_ahead`). The record's host timeline:
    `dispatch_s` (issuing the step's programs, transfers and update, of which `transfer_issue_s`
    the transfers), `device_wait_s` (reading the results), and the in-flight bound's waits inside
    dispatch.
    """
    schedule = schedule if schedule is not None else rt.schedule(samples)
    t0 = time.perf_counter()
    result = rt.executor.run(states, samples, schedule, host=host, norm=norm, ahead=ahead, step=step)
    finite = {s: rt.programs[s].all_finite(g) for s, g in result.grads.items()}
    norms_sq = rt.executor.squared_norms(result.grads)
    issued = IssuedStep(
        step,
        result.loss,
        finite,
        rt.graph.sink,
        on_nonfinite,
        {
            "step": step,
            "in_flight_waits": result.in_flight_waits,
            "in_flight_wait_s": result.in_flight_wait_s,
            "transfer_issue_s": result.transfer_issue_s,
        },
        norms_sq,
        rt.coordinator.fetch,
        result.metrics,
        float(result.norm),
    )
    if on_nonfinite == "skip":
        issued.record["dispatch_s"] = time.perf_counter() - t0
        issued.record["wait_reason"] = "on_nonfinite=skip"
        if issued.read().get("skipped_nonfinite"):
            return states, issued
        states = rt.executor.update(states, result.grads, norms_sq)
        issued.record.update(
            {f"lr/{s}": float(rt.coordinator.fetch(current_rate(states[s].opt_state))) for s in sorted(norms_sq)}
        )
        return states, issued
    states = rt.executor.update(states, result.grads, norms_sq)
    issued.rates = {s: current_rate(states[s].opt_state) for s in norms_sq}
    issued.record["dispatch_s"] = time.perf_counter() - t0
    return states, issued


def train_step(
    rt,
    states,
    samples,
    step: int,
    on_nonfinite: str = "stop",
    schedule=None,
    norm: int | None = None,
    host: dict | None = None,
):
    """One optimizer step, read at once: `issue_step` followed by `IssuedStep.read`.

    Returns the new states and the step's metrics record; under `on_nonfinite="stop"` a
    non-finite step raises `NonFiniteError` naming the step and the sections."""
    states, issued = issue_step(rt, states, samples, step, on_nonfinite, schedule, norm, host)
    return states, issued.read()
