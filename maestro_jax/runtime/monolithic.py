"""Monolithic baseline: the whole section graph as one jit over one mesh, one layout.

This is how a Megatron-style trainer runs a compound model: every component shares the same
devices, layout and micro-batch size, micro-batches go in arrival order and components run one
after the other inside each micro-batch. It is the reference for equivalence and the baseline
for benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maestro_jax.core.graph import SectionGraph, ask, sample_view
from maestro_jax.core.plan import SectionPlan
from maestro_jax.runtime.optimizer import squared_norm, update_fn
from maestro_jax.runtime.programs import SectionState, all_finite, tree_add
from maestro_jax.runtime.sharding import on_mesh, row_sharding


class Monolithic:
    def __init__(
        self,
        graph: SectionGraph,
        plan: SectionPlan,
        mesh,
        var_shardings: Mapping[str, dict],
        optimizers: Mapping[str, object],
        clip_norm: float | None = None,
        squared_norms: Mapping[str, Callable] | None = None,
    ):
        """`squared_norms`: section -> its gradients' squared norm for clipping (default
        `runtime.optimizer.squared_norm`; `section_squared_norm` leaves frozen parameters out)."""
        self.graph, self.plan, self.mesh = graph, plan, mesh
        self.row_sharding = row_sharding(mesh)
        self.trained = tuple(s.name for s in graph.sections if s.trained)
        self.optimizers = optimizers
        order, sink = graph.topological_order(), graph.sink

        def composed(params, consts, batches, norm):
            outs = {}
            for name in order:
                if batches.get(name) is None:
                    continue
                section = graph.section(name)
                inputs = {e.name: (outs[e.name],) if e.name in outs else None for e in graph.producers_of(name)}
                variables = {"params": params.get(name, {}), "consts": consts[name]}
                if name == sink:
                    loss_sum, metrics = section.forward(variables, inputs, batches[name])
                    return loss_sum / norm, metrics
                outs.update(section.forward(variables, inputs, batches[name]))
            raise ValueError("the sink section received no rows")

        def micro(params, consts, batches, norm, acc):
            (loss, metrics), grads = jax.value_and_grad(composed, has_aux=True)(params, consts, batches, norm)
            return loss, metrics, tree_add(acc, grads)

        p_sh = {s: var_shardings[s]["params"] for s in self.trained}
        self._micro = jax.jit(micro, out_shardings=(None, None, p_sh))
        self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=p_sh)
        self._all_finite = jax.jit(lambda grads: {s: all_finite(g) for s, g in grads.items()})
        self.clip_norm = clip_norm
        self._updates = {s: jax.jit(update_fn(optimizers[s], clip_norm)) for s in self.trained}
        self._squared_norms = {s: jax.jit((squared_norms or {}).get(s, squared_norm)) for s in self.trained}

    def host_batches(self, samples: Sequence) -> list[dict]:
        """Arrival-order micro-batches; every section sees the same rows (None: section idle)."""
        rows = self.plan.rows
        out = []
        for i in range(0, len(samples), rows):
            chunk = list(samples[i : i + rows]) + [None] * (rows - len(samples[i : i + rows]))
            batches = {}
            infos = [None if x is None else sample_view(x) for x in chunk]  # what the scheduler asks too
            for section in self.graph.sections:
                active = [x if x is not None and ask(section, "activates", i) else None for x, i in zip(chunk, infos)]
                if all(x is None for x in active):
                    batches[section.name] = None
                    continue
                routes = {
                    e.name: [
                        r if a is not None else -1
                        for r, a in enumerate(
                            x if x is not None and ask(self.graph.section(e.src), "activates", i) else None
                            for x, i in zip(chunk, infos)
                        )
                    ]
                    for e in self.graph.producers_of(section.name)
                }
                batches[section.name] = section.host_batch(active, routes)
            out.append(batches)
        return out

    def run(self, states: Mapping[str, SectionState], samples: Sequence, host: list | None = None):
        """(loss, metrics, grads) of one global batch: the loss divided by its normaliser, the
        sink's metrics summed over the batch (not normalised), the trained sections' gradients."""
        host = host if host is not None else self.host_batches(samples)
        norm = np.float32(max(self.graph.loss_count(samples), 1))
        params = {s: states[s].params for s in self.trained}
        consts = {s: st.consts for s, st in states.items()}
        with on_mesh(self.mesh, self.plan.rules):
            acc = self._zeros(params)
            loss, metrics = 0.0, {}
            for batches in host:
                dev = {
                    k: None if v is None else {n: jax.device_put(a, self.row_sharding) for n, a in v.items()}
                    for k, v in batches.items()
                }
                micro_loss, micro_metrics, acc = self._micro(params, consts, dev, norm, acc)
                loss = loss + micro_loss
                metrics = micro_metrics if not metrics else jax.tree.map(jnp.add, metrics, micro_metrics)
        return loss, metrics, acc

    def all_finite(self, grads) -> dict[str, object]:
        """Each trained section's gradients are finite: a device bool per section."""
        with on_mesh(self.mesh, self.plan.rules):
            return self._all_finite(grads)

    def squared_norms(self, grads) -> dict[str, object]:
        with on_mesh(self.mesh, self.plan.rules):
            return {s: self._squared_norms[s](grads[s]) for s in self.trained}

    def update(self, states: Mapping[str, SectionState], grads, norms_sq=None) -> dict[str, SectionState]:
        """Every section's optimizer step, clipped by the norm over all of them (`runtime.optimizer`:
        the same sums in the same order as the sections' updates); `norms_sq`:
        `squared_norms(grads)`, where the caller has them."""
        here = ()
        if self.clip_norm is not None:
            norms = self.squared_norms(grads) if norms_sq is None else norms_sq
            here = tuple(norms[s] for s in sorted(self.trained))
        new = dict(states)
        with on_mesh(self.mesh, self.plan.rules):
            for s in self.trained:
                params, opt = self._updates[s](states[s].params, states[s].opt_state, grads[s], here)
                new[s] = SectionState(params, states[s].consts, opt)
        return new
