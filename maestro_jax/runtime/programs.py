"""Per-section jitted programs, each compiled for the section's own mesh.

A section's program family (docs/ARCHITECTURE.md, "Runtime"):
  forward        frozen producers: outputs only;
  forward_vjp    trained producers: outputs plus what backward needs (vjp residuals or, with
                 `residuals: remat`, nothing: backward recomputes the forward);
  backward       takes the summed output cotangent, adds parameter grads into the accumulator;
  loss_and_grad  the sink: loss, parameter grads (accumulated) and cotangents of its inputs;
  update         optax on the section's params and optimizer state, its grads clipped by the
                 global norm over every trained section (`runtime.optimizer`);
  squared_norm   its grads' squared norm, replicated on its mesh: its share of that global norm.
jax.jit caches one executable per input shape, i.e. per shape bucket. Every call runs under
`sharding.on_mesh(section mesh, its rules)` so constants created inside land on the section's
devices and the models' activation constraints (sequence over `context`, ...) resolve.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maestro_jax.core.graph import Section
from maestro_jax.runtime.optimizer import squared_norm, update_fn
from maestro_jax.runtime.sharding import on_mesh, row_sharding


@dataclasses.dataclass
class SectionState:
    """A section's persistent state on its mesh."""

    params: Any
    consts: Any
    opt_state: Any = None

    @property
    def variables(self) -> dict:
        return {"params": self.params, "consts": self.consts}


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


class SectionPrograms:
    def __init__(
        self,
        section: Section,
        mesh,
        var_shardings,
        optimizer: optax.GradientTransformation,
        residuals: str,
        out_edges: tuple[str, ...],
        diff_inputs: tuple[str, ...],
        is_sink: bool,
        rules: str = "default",
        clip_norm: float | None = None,
    ):
        self.section, self.mesh, self.optimizer, self.rules = section, mesh, optimizer, rules
        self.clip_norm = clip_norm
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = row_sharding(mesh)
        self.var_shardings = var_shardings
        self.residuals = residuals
        self.diff_inputs = diff_inputs  # in-edges whose producer is trained: we return their cotangents
        fwd = section.forward
        # Buffers are donated on accelerators. On CPU they are not (callers there, tests and verify,
        # reuse a state after a step), but memory is measured as if they were (`_run`).
        donate = mesh.devices.flat[0].platform != "cpu"

        def split_inputs(inputs):
            diff = {k: v for k, v in inputs.items() if k in diff_inputs}
            rest = {k: v for k, v in inputs.items() if k not in diff_inputs}
            return diff, rest

        def forward(variables, inputs, batch):
            return fwd(variables, inputs, batch)

        def vjp_of(variables, inputs, batch):
            diff, rest = split_inputs(inputs)
            return jax.vjp(
                lambda p, d: fwd({**variables, "params": p}, {**rest, **d}, batch), variables["params"], diff
            )

        def forward_vjp(variables, inputs, batch):
            out, vjp = vjp_of(variables, inputs, batch)
            return out, vjp

        def backward(vjp, cotangent, acc):
            grads, d_inputs = vjp(cotangent)
            return tree_add(acc, grads), d_inputs

        def backward_remat(variables, inputs, batch, cotangent, acc):
            grads, d_inputs = vjp_of(variables, inputs, batch)[1](cotangent)
            return tree_add(acc, grads), d_inputs

        def loss_and_grad(variables, inputs, batch, norm, acc):
            diff, rest = split_inputs(inputs)

            def loss_fn(p, d):
                loss_sum, metrics = fwd({**variables, "params": p}, {**rest, **d}, batch)
                return loss_sum / norm, metrics

            (loss, metrics), (grads, d_inputs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                variables["params"], diff
            )
            return loss, metrics, tree_add(acc, grads), d_inputs

        outs = dict.fromkeys(out_edges, self.rows)
        p_sh = var_shardings["params"]

        def jit(fun, donated=(), **kw):
            program = jax.jit(fun, donate_argnums=donated if donate else (), **kw)
            program.donating = jax.jit(fun, donate_argnums=donated, **kw)  # what `_run` measures
            return program

        self._forward = jit(forward, out_shardings=outs)
        self._forward_vjp = jit(forward_vjp, out_shardings=(outs, None))
        self._backward = jit(backward, (2,), out_shardings=(p_sh, None))
        self._backward_remat = jit(backward_remat, (4,), out_shardings=(p_sh, None))
        self._loss_and_grad = jit(loss_and_grad, (4,), out_shardings=(None, None, p_sh, None))
        self._update = jit(update_fn(optimizer, clip_norm), (0, 1))
        self._squared_norm = jax.jit(squared_norm, out_shardings=self.replicated)
        self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=p_sh)
        self._all_finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)])))
        self._init_opt = jax.jit(optimizer.init)

    # Each wrapper enters the section mesh: constants traced inside land on its devices.
    memory: dict[str, int] | None = None  # when a dict: each program's compiled per-device peak bytes

    def _run(self, name: str, program, *args):
        """Call `program`; while `memory` is a dict, also record its compiled memory analysis
        (arguments + outputs + temporaries - aliased, per device) under `name`, with the buffers an
        accelerator would donate donated, so outputs that reuse them are not counted twice."""
        if self.memory is not None:
            m = program.donating.lower(*args).compile().memory_analysis()
            if m is not None:
                peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
                self.memory[name] = max(self.memory.get(name, 0), int(peak))
        return program(*args)

    def forward(self, state: SectionState, inputs, batch):
        with on_mesh(self.mesh, self.rules):
            return self._run("forward", self._forward, state.variables, inputs, batch)

    def forward_vjp(self, state: SectionState, inputs, batch):
        """Outputs and the handle `backward` needs: vjp residuals, or the inputs to recompute from."""
        with on_mesh(self.mesh, self.rules):
            if self.residuals == "remat":
                return self._run("forward", self._forward, state.variables, inputs, batch), (inputs, batch)
            return self._run("forward_vjp", self._forward_vjp, state.variables, inputs, batch)

    def backward(self, state: SectionState, handle, cotangent, acc):
        with on_mesh(self.mesh, self.rules):
            if self.residuals == "remat":
                inputs, batch = handle
                return self._run("backward", self._backward_remat, state.variables, inputs, batch, cotangent, acc)
            return self._run("backward", self._backward, handle, cotangent, acc)

    def loss_and_grad(self, state: SectionState, inputs, batch, norm, acc):
        with on_mesh(self.mesh, self.rules):
            return self._run("loss_and_grad", self._loss_and_grad, state.variables, inputs, batch, norm, acc)

    def all_finite(self, tree):
        """A device scalar: every element of `tree` (e.g. this section's grads) is finite."""
        with on_mesh(self.mesh, self.rules):
            return self._all_finite(tree)

    def zeros_like_params(self, state: SectionState):
        with on_mesh(self.mesh, self.rules):
            return self._zeros(state.params)

    def init_optimizer(self, params):
        with on_mesh(self.mesh, self.rules):
            return self._init_opt(params)

    def squared_norm(self, grads):
        """A device scalar replicated on this section's mesh: the squared norm of `grads`."""
        with on_mesh(self.mesh, self.rules):
            return self._squared_norm(grads)

    def update(self, state: SectionState, grads, norms_sq: tuple = ()) -> SectionState:
        """`norms_sq`: every trained section's squared grad norm on this mesh, in the order all
        updates sum them (with `clip_norm`; empty otherwise)."""
        with on_mesh(self.mesh, self.rules):
            params, opt_state = self._run("update", self._update, state.params, state.opt_state, grads, norms_sq)
        return SectionState(params, state.consts, opt_state)

    def put_batch(self, batch: dict):
        """Host arrays of one micro-step onto the section's devices, rows over data shards.

        Every process holds the whole micro-step on the host (the schedule is the same
        everywhere); across processes each one places only its own devices' rows."""
        if self.rows.is_fully_addressable:
            return {k: jax.device_put(v, self.rows) for k, v in batch.items()}
        return {
            k: jax.make_array_from_callback(v.shape, self.rows, lambda idx, v=v: v[idx], dtype=v.dtype)
            for k, v in batch.items()
        }
