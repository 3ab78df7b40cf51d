"""Per-section programs, compiled ahead of time for the section's own mesh and held as executables.

A section's program family (docs/ARCHITECTURE.md, "Runtime"):
  forward        frozen producers (and every producer in evaluation): outputs only;
  forward_vjp    trained producers: outputs plus what backward needs (vjp residuals or, with
                 `residuals: remat`, nothing: backward recomputes the forward);
  backward       takes the summed output cotangent, adds parameter grads into the accumulator;
  loss_and_grad  the sink: loss, parameter grads (accumulated) and cotangents of its inputs;
  loss           the sink in evaluation: the loss alone, forward only;
  forward_run    `forward` over k consecutive micro-steps of one signature, one launch (a scan:
                 `compile.scan_micro_steps`), each micro-step's outputs returned apart;
  loss_and_grad_run  `loss_and_grad` over k such micro-steps, the grad accumulator carried
                 through the scan (MaxText's gradient accumulation), each one's loss, metrics and
                 input cotangents returned apart;
  update         optax on the section's params and optimizer state, its grads clipped by the
                 global norm over every trained section (`runtime.optimizer`);
  squared_norm   its grads' squared norm, replicated on its mesh: its share of that global norm;
and the small ones a step also needs: zeros (the grad accumulator), all_finite, init_opt, add
(summing losses, metrics and cotangents) and zeros_like (the cotangent of an unused output).

Each program is compiled once per *signature*: `jax.jit(fun).trace(*abstract).lower().compile()`
under `sharding.on_mesh(section mesh, its rules)` (constants land on the section's devices, the
models' activation constraints resolve), and the executable is kept in `SectionPrograms.cache`
under (kind, signature). A signature is what varies between calls, per array leaf its shape,
dtype, weak type and sharding: a shape bucket of the batch and edge inputs. A section state's
leaves (params, consts, optimizer state) enter through `state_key`, computed once per
`SectionState`; the grad accumulator always has the params' layout (every program that returns
it pins it), so it is left out. A call whose signature is not in the cache compiles it there
and then (lazily, with a log line): `SectionedStep.compile` fills the cache before step 1.

Every output that another program or a transfer consumes has a pinned sharding (edges and input
cotangents: rows over the data axes; losses, metrics, norms: replicated; grads: the params'
layout; the updated state: the layout it came in), so the signature of every later call is known
from the first compile alone. The one layout XLA picks is that of vjp residuals, which only
`backward` reads.

A section's abstract twin (`SectionPrograms.abstract(run)`, for a `DryRun`) shares its caches but
does not run: given abstract arguments (`jax.ShapeDtypeStruct`s) its calls return abstract outputs
and record (trace mode) or compile (compile mode) each signature; `runtime.ahead` drives the
step's abstract twin (`SectionedStep.abstract`) through whole steps this way.
Memory comes from the executables' `memory_analysis()` (`SectionPrograms.memory_analysis`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maestro_jax.core.graph import GraphError, Section
from maestro_jax.runtime.optimizer import squared_norm, update_fn
from maestro_jax.runtime.sharding import edge_sharding, on_mesh, row_sharding

log = logging.getLogger("maestro_jax")

# program kinds whose memory `memory_analysis` reports, under the names the planner's model uses
MEASURED = {
    "forward": "forward",
    "forward_vjp": "forward_vjp",
    "backward": "backward",
    "backward_remat": "backward",
    "loss_and_grad": "loss_and_grad",
    "forward_run": "forward",  # a run holds its k micro-steps' outputs at once: its peak counts
    "loss_and_grad_run": "loss_and_grad",
    "update": "update",
}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "consts", "opt_state"], meta_fields=[])
@dataclasses.dataclass
class SectionState:
    """A section's persistent state on its mesh (a pytree: `jax.tree` functions see its arrays)."""

    params: Any
    consts: Any
    opt_state: Any = None

    @property
    def variables(self) -> dict:
        return {"params": self.params, "consts": self.consts}


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def all_finite(tree):
    """Whether every element of `tree` is finite: one boolean scalar (traced inside a program)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


# -- signatures ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _sharding_key(sharding) -> object:
    """A sharding as a key: equivalent NamedShardings (trailing unsharded dims, default memory
    kind) compare equal."""
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        spec = tuple(s[0] if isinstance(s, tuple) and len(s) == 1 else s for s in spec)
        return ("named", sharding.mesh, spec, sharding.memory_kind or "device")
    return sharding


def _leaf_key(x) -> tuple:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = x.sharding
        return (tuple(x.shape), x.dtype, x.weak_type, None if sharding is None else _sharding_key(sharding))
    return (np.shape(x), jax.dtypes.canonicalize_dtype(np.result_type(x)), False, None)


def signature(tree) -> tuple:
    """The key of a pytree of arrays (real or abstract): its structure and per leaf shape, dtype,
    weak type and sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_leaf_key(x) for x in leaves)


def state_key(state: SectionState) -> tuple:
    """`signature` of a state's params, consts and optimizer state, computed once per state."""
    ids = (id(state.params), id(state.consts), id(state.opt_state))
    held = state.__dict__.get("_key")
    if held is not None and held[0] == ids:
        return held[1]
    key = signature((state.params, state.consts, state.opt_state))
    state.__dict__["_key"] = (ids, key)
    return key


def abstract(x):
    """A leaf as a `jax.ShapeDtypeStruct` (with its sharding and weak type where it has them)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(np.result_type(x)))


def _shardings_of(tree):
    """The shardings of a tree's leaves as an `out_shardings` value; None (XLA picks) when any leaf
    has none (an abstract value whose layout is not known yet)."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]
    if any(s is None for s in shardings):
        return None
    return jax.tree.map(lambda x: x.sharding, tree)


# -- compiled programs --------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """One executable: a program kind compiled for one signature."""

    kind: str
    key: tuple
    executable: jax.stages.Compiled
    args: tuple  # the abstract arguments it was compiled for
    compile_s: float
    lazily: bool  # compiled by a call (a shape nothing compiled ahead), not ahead

    @functools.cached_property
    def out_info(self):
        return self.executable.out_info


def _known(out_info) -> bool:
    """Every leaf of a program's abstract outputs has its layout (a pinned out_sharding)."""
    return all(x.sharding is not None for x in jax.tree.leaves(out_info))


class DryRun:
    """What a dry run of the executor over abstract values does with each program call.

    compile=False (trace mode): trace each new signature (no compile) and record it, so that the
    number of programs to compile is known before compiling; compile=True: compile each new
    signature into its section's cache (reusing `traced` from a trace-mode pass). With `pool` (a
    `concurrent.futures` executor), a program whose outputs' layouts are all pinned compiles there
    while the walk goes on (`finish` waits for them); the others (vjp residuals, optimizer state:
    layouts XLA picks) compile at once, since later signatures depend on them."""

    def __init__(self, compile: bool, traced: dict | None = None, pool=None):
        self.compile, self.pool = compile, pool
        self.traced: dict[tuple, Any] = dict(traced or {})  # (section, kind, key) -> jax.stages.Traced
        self.new: list[tuple[str, str, tuple]] = []  # (section, kind, key) first met by this dry run, not cached
        self.used: dict[str, set] = {}  # section -> every (kind, key) called, cached or not
        self.transfers: dict[tuple, tuple] = {}  # transfer program key -> (program, args), not compiled yet
        self.on_compile = lambda: None  # called after each compile (progress)
        self._seen: dict[tuple, Any] = {}  # (section, kind, key) -> its abstract outputs
        self._futures: list = []

    def visit(self, prog: SectionPrograms, kind: str, key: tuple, args: tuple):
        self.used.setdefault(prog.name, set()).add((kind, key))
        entry = prog.cache.get((kind, key))
        if entry is not None:
            return entry.out_info
        seen = (prog.name, kind, key)
        if seen in self._seen:
            return self._seen[seen]
        self.new.append(seen)
        if not self.compile:
            traced = self.traced.get(seen)
            if traced is None:
                traced = self.traced[seen] = prog._trace(kind, args)
            out = traced.out_info
        else:
            traced = self.traced.pop(seen, None) or prog._trace(kind, args)
            if self.pool is not None and _known(traced.out_info):
                self._futures.append(self.pool.submit(self._compile, prog, kind, key, args, traced))
                out = traced.out_info
            else:
                out = self._compile(prog, kind, key, args, traced).out_info
        self._seen[seen] = out
        return out

    def _compile(self, prog: SectionPrograms, kind: str, key: tuple, args: tuple, traced) -> Program:
        entry = prog._compile(kind, key, args, traced=traced)
        self.on_compile()
        return entry

    def submit(self, fun, *args) -> None:
        """Run `fun(*args)` on the pool (at once without one)."""
        if self.pool is None:
            fun(*args)
        else:
            self._futures.append(self.pool.submit(fun, *args))

    def finish(self) -> None:
        """Wait for the compiles on the pool; the first error raised there is raised here."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()


_TAKES_INPUTS = (
    "forward",
    "forward_vjp",
    "backward_remat",
    "loss_and_grad",
    "loss",
    "forward_run",
    "loss_and_grad_run",
)


def _stacked(trees):
    """k pytrees of one structure and shapes as one, each leaf stacked on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _apart(tree, k: int) -> tuple:
    """`_stacked`'s inverse: the k pytrees along the leading axis."""
    return tuple(jax.tree.map(lambda x, i=i: x[i], tree) for i in range(k))


def scanned_forward(forward):
    """`forward(variables, inputs, batch)` over k micro-steps in one program: a `lax.scan` over
    their stacked inputs and batches (one compiled body, whatever k), the outputs apart again."""

    def run(variables, inputs_k, batches_k):
        _, out = jax.lax.scan(
            lambda _, xs: (None, forward(variables, *xs)), None, _stacked(list(zip(inputs_k, batches_k)))
        )
        return _apart(out, len(batches_k))

    return run


def scanned_loss_and_grad(loss_and_grad):
    """`loss_and_grad(variables, inputs, batch, norm, acc)` over k micro-steps in one program, the
    accumulator carried from one to the next as the unfused calls pass it on."""

    def run(variables, inputs_k, batches_k, norm, acc):
        def body(acc, xs):
            loss, metrics, acc, d_inputs = loss_and_grad(variables, *xs, norm, acc)
            return acc, (loss, metrics, d_inputs)

        acc, (losses, metrics, d_inputs) = jax.lax.scan(body, acc, _stacked(list(zip(inputs_k, batches_k))))
        k = len(batches_k)
        return _apart(losses, k), _apart(metrics, k), acc, _apart(d_inputs, k)

    return run


def _shape_text(tree) -> str:
    """`{key: dtype[shape]}` of a batch or inputs (tuples per edge), for an error line."""
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k}: {_shape_text(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        return "(" + ", ".join(_shape_text(v) for v in tree) + ")"
    return f"{tree.dtype}{list(tree.shape)}" if hasattr(tree, "shape") else type(tree).__name__


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as a function is
class SectionFunctions:
    """The functions a section's programs compile, from its `forward` (`fwd`): `diff_inputs`, the
    in-edges whose producer is trained (their cotangents are returned), and `out_edges`, what a
    producer must return; a forward that returns something else is a `GraphError` naming the
    section, raised while tracing."""

    name: str
    fwd: Callable
    out_edges: tuple[str, ...]
    diff_inputs: tuple[str, ...]

    def split_inputs(self, inputs):
        diff = {k: v for k, v in inputs.items() if k in self.diff_inputs}
        rest = {k: v for k, v in inputs.items() if k not in self.diff_inputs}
        return diff, rest

    def outputs(self, out):
        """A producer returns one array per out-edge, by the edge's name."""
        missing = sorted(set(self.out_edges) - set(out if isinstance(out, dict) else ()))
        if missing:
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise GraphError(
                f"error: section {self.name!r}: forward returns {got}, without its out-edge "
                f"{missing[0]!r}; return {{edge name: array}} for each of {sorted(self.out_edges)}"
            )
        return out

    def sink_result(self, out):
        """The sink returns (its loss summed over the batch, {metric name: array})."""
        if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], Mapping):
            return out
        got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, tuple | list) else _value_text(out)
        raise GraphError(
            f"error: section {self.name!r}: forward returns {got}; the sink section returns (loss summed "
            f"over the batch, {{metric name: array}}), an empty dict for no metrics"
        )

    def forward(self, variables, inputs, batch):
        return self.outputs(self.fwd(variables, inputs, batch))

    def vjp_of(self, variables, inputs, batch):
        diff, rest = self.split_inputs(inputs)
        return jax.vjp(
            lambda p, d: self.outputs(self.fwd({**variables, "params": p}, {**rest, **d}, batch)),
            variables["params"],
            diff,
        )

    def forward_vjp(self, variables, inputs, batch):
        out, vjp = self.vjp_of(variables, inputs, batch)
        return out, vjp

    @staticmethod
    def backward(vjp, cotangent, acc):
        grads, d_inputs = vjp(cotangent)
        return tree_add(acc, grads), d_inputs

    def backward_remat(self, variables, inputs, batch, cotangent, acc):
        grads, d_inputs = self.vjp_of(variables, inputs, batch)[1](cotangent)
        return tree_add(acc, grads), d_inputs

    def loss_and_grad(self, variables, inputs, batch, norm, acc):
        diff, rest = self.split_inputs(inputs)

        def loss_fn(p, d):
            loss_sum, metrics = self.sink_result(self.fwd({**variables, "params": p}, {**rest, **d}, batch))
            return loss_sum / norm, metrics

        (loss, metrics), (grads, d_inputs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            variables["params"], diff
        )
        return loss, metrics, tree_add(acc, grads), d_inputs

    def loss(self, variables, inputs, batch, norm):
        loss_sum, metrics = self.sink_result(self.fwd(variables, inputs, batch))
        return loss_sum / norm, metrics


def zeros(params):
    return jax.tree.map(jnp.zeros_like, params)


def zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _program_kinds(
    fns: SectionFunctions, mesh, p_sh, optimizer: optax.GradientTransformation, clip_norm, squared_norm: Callable
) -> dict[str, tuple[Callable, tuple[int, ...], Callable]]:
    """kind -> (function, donated arguments, out_shardings from the abstract arguments). Edge
    arrays (out-edges, the cotangents of in-edges) are laid out by shape: a forward's are known
    by tracing it for shapes first, the cotangents of inputs from the inputs; the params' layout
    is `p_sh`, everything else small replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    forward, split_inputs = fns.forward, fns.split_inputs

    def edges(tree):
        """Each edge array's layout (`edge_sharding`), from its abstract value."""
        return jax.tree.map(lambda x: edge_sharding(mesh, x.shape), tree)

    return {
        "forward": (forward, (), lambda a: edges(jax.eval_shape(forward, *a))),
        "forward_vjp": (fns.forward_vjp, (), lambda a: (edges(jax.eval_shape(forward, *a)), None)),
        "backward": (fns.backward, (2,), lambda a: (p_sh, edges(jax.eval_shape(fns.backward, *a)[1]))),
        "backward_remat": (fns.backward_remat, (4,), lambda a: (p_sh, edges(split_inputs(a[1])[0]))),
        "loss_and_grad": (fns.loss_and_grad, (4,), lambda a: (rep, rep, p_sh, edges(split_inputs(a[1])[0]))),
        "loss": (fns.loss, (), lambda a: (rep, rep)),
        "forward_run": (
            scanned_forward(forward),
            (),
            lambda a: (edges(jax.eval_shape(forward, a[0], a[1][0], a[2][0])),) * len(a[2]),
        ),
        "loss_and_grad_run": (
            scanned_loss_and_grad(fns.loss_and_grad),
            (4,),
            lambda a: (rep, rep, p_sh, tuple(edges(split_inputs(i)[0]) for i in a[1])),
        ),
        # the updated state keeps the layout it came in with: the next update's signature
        "update": (update_fn(optimizer, clip_norm), (0, 1), lambda a: (p_sh, _shardings_of(a[1]))),
        "squared_norm": (squared_norm, (), lambda a: rep),
        "zeros": (zeros, (), lambda a: p_sh),
        "all_finite": (all_finite, (), lambda a: rep),
        "init_opt": (optimizer.init, (), lambda a: None),
        "add": (tree_add, (), lambda a: _shardings_of(a[0])),
        "zeros_like": (zeros_like, (), lambda a: _shardings_of(a[0])),
    }


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
        squared_norm: Callable = squared_norm,  # its share of the clip norm (frozen params left out)
        donate: bool | None = None,
    ):
        self.section, self.mesh, self.optimizer, self.rules = section, mesh, optimizer, rules
        self.name = section.name
        self.clip_norm = clip_norm
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.row_sharding = row_sharding(mesh)
        self.var_shardings = var_shardings
        self.residuals = residuals
        self.diff_inputs = diff_inputs  # in-edges whose producer is trained: we return their cotangents
        self.cache: dict[tuple[str, tuple], Program] = {}  # (kind, signature) -> executable
        self.step: int | None = None  # the training step being issued (for the lazy-compile log line)
        self.compiled_ahead = False  # set by `SectionedStep.compile`: a lazy compile is then a warning
        self.dry: DryRun | None = None  # an abstract twin's dry run (`abstract`): calls go to it
        self._lock = threading.Lock()
        # `donate` (`compile.donate`; None: on accelerators only): the update program takes the
        # section's params and optimizer state, and the backward programs the grad accumulator, as
        # its outputs' buffers, so an update does not hold two copies. On CPU by default it does
        # not (callers there, tests, reuse a state after a step), but memory is measured as if it
        # did (`memory_analysis`).
        self.donate = mesh.devices.flat[0].platform != "cpu" if donate is None else donate
        self._kinds = _program_kinds(
            SectionFunctions(section.name, section.forward, tuple(out_edges), tuple(diff_inputs)),
            mesh,
            var_shardings["params"],
            optimizer,
            clip_norm,
            squared_norm,
        )

    # -- compiling --------------------------------------------------------------------------

    def _jit(self, kind: str, args: tuple, donate: bool):
        fun, donated, outs = self._kinds[kind]
        return jax.jit(fun, donate_argnums=donated if donate else (), out_shardings=outs(args))

    def _trace(self, kind: str, args: tuple, donate: bool | None = None):
        """`kind` traced on `args` (abstract). A section's own code that does not fit the shapes
        it is given (a forward expecting another width, a batch key its host_batch did not
        make) fails here, before anything compiles: one `GraphError` naming the section, the
        program and the shapes of its inputs and batch, with the error's first line."""
        args = jax.tree.map(abstract, args)
        try:
            with on_mesh(self.mesh, self.rules):
                return self._jit(kind, args, self.donate if donate is None else donate).trace(*args)
        except GraphError:
            raise
        except Exception as err:
            given = ""
            if kind in _TAKES_INPUTS:
                given = f" (inputs {_shape_text(args[1])}, batch {_shape_text(args[2])})"
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise GraphError(
                f"error: section {self.name!r}: its {kind} program cannot be traced on this batch's shapes"
                f"{given}: {type(err).__name__}: {first}"
            ) from err

    def _compile(self, kind: str, key: tuple, args: tuple, traced=None, lazily: bool = False) -> Program:
        """Compile `kind` for `args` into the cache under `key` (thread-safe: a signature two
        threads compile at once is kept once)."""
        entry = self.cache.get((kind, key))
        if entry is not None:
            return entry
        if lazily:
            level = logging.WARNING if self.compiled_ahead else logging.DEBUG
            log.log(
                level,
                "compiling a new shape bucket for section %s at step %s (%s)",
                self.name,
                "?" if self.step is None else self.step,
                kind,
            )
        t0 = time.perf_counter()
        traced = traced if traced is not None else self._trace(kind, args)
        with on_mesh(self.mesh, self.rules):
            executable = traced.lower().compile()
        entry = Program(kind, key, executable, jax.tree.map(abstract, args), time.perf_counter() - t0, lazily)
        with self._lock:
            return self.cache.setdefault((kind, key), entry)

    def abstract(self, run: DryRun) -> SectionPrograms:
        """This section's programs over abstract values: the same caches (a compile lands in
        them), every call handed to `run` (traced or compiled, never run)."""
        twin = copy.copy(self)
        twin.dry = run
        return twin

    def _call(self, kind: str, key: tuple, *args):
        if self.dry is not None:
            return self.dry.visit(self, kind, key, args)
        entry = self.cache.get((kind, key))
        if entry is None:
            entry = self._compile(kind, key, args, lazily=True)
        return entry.executable(*args)

    def memory_analysis(self, keys=None) -> dict[str, int]:
        """Per program (the `MEASURED` names), the largest compiled per-device peak over its
        signatures in the cache (all, or those in `keys`: (kind, signature) pairs): arguments +
        outputs + temporaries - aliased, with the buffers an accelerator donates donated (on CPU,
        where the executables do not donate, each is compiled again with donation to measure it),
        so outputs that reuse them are not counted twice."""
        out: dict[str, int] = {}
        for (kind, key), entry in list(self.cache.items()):
            if kind not in MEASURED or (keys is not None and (kind, key) not in keys):
                continue
            executable = entry.executable
            if not self.donate and self._kinds[kind][1]:
                executable = self._trace(kind, entry.args, donate=True).lower().compile()
            m = executable.memory_analysis()
            if m is None:
                continue
            peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
            name = MEASURED[kind]
            out[name] = max(out.get(name, 0), int(peak))
        return out

    # -- the programs -----------------------------------------------------------------------

    def forward(self, state: SectionState, inputs, batch):
        return self._call("forward", (state_key(state), signature((inputs, batch))), state.variables, inputs, batch)

    def forward_vjp(self, state: SectionState, inputs, batch):
        """Outputs and the handle `backward` needs: vjp residuals, or the inputs to recompute from."""
        if self.residuals == "remat":
            return self.forward(state, inputs, batch), (inputs, batch)
        return self._call("forward_vjp", (state_key(state), signature((inputs, batch))), state.variables, inputs, batch)

    def backward(self, state: SectionState, handle, cotangent, acc):
        if self.residuals == "remat":
            inputs, batch = handle
            return self._call(
                "backward_remat",
                (state_key(state), signature((inputs, batch, cotangent))),
                state.variables,
                inputs,
                batch,
                cotangent,
                acc,
            )
        return self._call("backward", signature((handle, cotangent)), handle, cotangent, acc)

    def loss_and_grad(self, state: SectionState, inputs, batch, norm, acc):
        return self._call(
            "loss_and_grad",
            (state_key(state), signature((inputs, batch, norm))),
            state.variables,
            inputs,
            batch,
            norm,
            acc,
        )

    def forward_run(self, state: SectionState, inputs_k: tuple, batches_k: tuple) -> tuple:
        """`forward` of k micro-steps of one signature in one launch: their outputs, in order."""
        return self._call(
            "forward_run", (state_key(state), signature((inputs_k, batches_k))), state.variables, inputs_k, batches_k
        )

    def loss_and_grad_run(self, state: SectionState, inputs_k: tuple, batches_k: tuple, norm, acc):
        """`loss_and_grad` of k micro-steps of one signature in one launch: their losses, metrics
        and input cotangents (each a k-tuple, in order) and the accumulator after the last."""
        return self._call(
            "loss_and_grad_run",
            (state_key(state), signature((inputs_k, batches_k, norm))),
            state.variables,
            inputs_k,
            batches_k,
            norm,
            acc,
        )

    def loss(self, state: SectionState, inputs, batch, norm):
        """The sink's loss (summed over its rows, divided by `norm`) and metrics, forward only."""
        return self._call(
            "loss", (state_key(state), signature((inputs, batch, norm))), state.variables, inputs, batch, norm
        )

    def all_finite(self, tree):
        """A device scalar: every element of `tree` (e.g. this section's grads) is finite."""
        return self._call("all_finite", signature(tree), tree)

    def zeros_like_params(self, state: SectionState):
        return self._call("zeros", state_key(state), state.params)

    def zeros_like(self, tree):
        """Zeros of `tree`'s shapes and layout (on this section's mesh)."""
        return self._call("zeros_like", signature(tree), tree)

    def add(self, a, b):
        """`a + b` leaf by leaf, in `a`'s layout (losses, metrics, cotangents of this mesh)."""
        return self._call("add", signature((a, b)), a, b)

    def init_optimizer(self, params):
        return self._call("init_opt", signature(params), params)

    def squared_norm(self, grads):
        """A device scalar replicated on this section's mesh: the squared norm of `grads`."""
        return self._call("squared_norm", signature(grads), grads)

    def update(self, state: SectionState, grads, norms_sq: tuple = ()) -> SectionState:
        """`norms_sq`: every trained section's squared grad norm on this mesh, in the order all
        updates sum them (with `clip_norm`; empty otherwise)."""
        params, opt_state = self._call(
            "update", (state_key(state), signature((grads, norms_sq))), state.params, state.opt_state, grads, norms_sq
        )
        return SectionState(params, state.consts, opt_state)

    def edge_sharding(self, shape: tuple[int, ...]):
        """The layout an edge array of `shape` takes on this section's mesh (`edge_sharding`): where
        a transfer delivers an input or returns a cotangent."""
        return edge_sharding(self.mesh, tuple(shape))

    def put_batch(self, batch: dict):
        """Host arrays of one micro-step onto the section's devices, rows over data shards.

        Every process holds the whole micro-step on the host (the schedule is the same
        everywhere); across processes each one places only its own devices' rows. During a dry run,
        the arrays' abstract values on those devices. What is no numeric array of one shape (a
        ragged list, objects, strings) is a `GraphError` naming the section and the key."""
        batch = host_arrays(self.name, batch)
        if self.dry is not None:
            return {
                k: jax.ShapeDtypeStruct(np.shape(v), jax.dtypes.canonicalize_dtype(v.dtype), sharding=self.row_sharding)
                for k, v in batch.items()
            }
        if self.row_sharding.is_fully_addressable:
            return {k: jax.device_put(v, self.row_sharding) for k, v in batch.items()}
        return {
            k: jax.make_array_from_callback(v.shape, self.row_sharding, lambda idx, v=v: v[idx], dtype=v.dtype)
            for k, v in batch.items()
        }


def _value_text(x) -> str:
    """A value as an error names it: an array by its dtype and shape, anything else by its type."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    return f"one array ({dtype}{list(shape)})" if shape is not None and dtype is not None else type(x).__name__


def host_arrays(section: str, batch) -> dict[str, np.ndarray]:
    """A section's `host_batch` result as numpy arrays, or a `GraphError` naming the section and
    the key that is no numeric array of one shape (the contract: {key: array}, bool, integer or
    float, every row of a key the same shape)."""
    if not isinstance(batch, Mapping):
        raise GraphError(
            f"error: section {section!r}: host_batch returns {type(batch).__name__}; it returns {{key: numpy array}}"
        )
    out = {}
    for key, value in batch.items():
        try:
            array = np.asarray(value)
        except ValueError as err:
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise GraphError(
                f"error: section {section!r}: host_batch returns {key!r} as no array of one shape ({first}); "
                f"host_batch returns numpy arrays, each row of a key the same shape (pad ragged rows)"
            ) from None
        if array.dtype.kind not in "biuf":
            raise GraphError(
                f"error: section {section!r}: host_batch returns {key!r} of dtype {array.dtype}; host_batch returns "
                f"bool, integer or float arrays"
            )
        out[key] = array
    return out
