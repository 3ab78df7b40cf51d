"""A staged section's states seen as one section's, and back (`core.stages`).

A section in K pipeline stages runs as K sections, each with its own params, constants and
optimizer state on its own devices. Checkpoints, exports and the optimizer's per-section checks
see the section whole: `whole_states` joins the stages' states into the section's (the arrays
stay where they are: a checkpoint writes each leaf from its own devices), `stage_states` cuts a
section's states into the stages of the current plan, whatever stage count they were saved with.
Both are a regrouping of leaves by path: a stage's variables are the matching subtree of the
section's (`core.stages.StageSplit.owner`), and so is its optimizer state, whose leaves sit under
the same parameter paths (optax's moments mirror the parameter tree); what no parameter owns
(the update count, the injected learning rate) is the same in every stage and taken from the first.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping

import jax

from maestro_jax.core.graph import SectionGraph
from maestro_jax.core.stages import merge_variables, split_variables
from maestro_jax.runtime.programs import SectionPrograms, SectionState
from maestro_jax.runtime.transfer import transfer


def _keys(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _leaves(tree) -> dict[str, object]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def whole_params(graph: SectionGraph, params: Mapping[str, object]) -> dict[str, object]:
    """Params by section (each staged section's stages joined) from params by graph section
    (some of them: a section none of whose stages `params` holds is left out)."""
    staging = graph.staging
    if staging is None:
        return dict(params)
    out = {}
    for section in staging.whole.names:
        stages = staging.stages_of(section)
        if stages[0] not in params:
            continue
        if len(stages) == 1:
            out[section] = params[section]
        else:
            out[section] = merge_variables([{"params": params[s], "consts": {}} for s in stages])["params"]
    return out


def whole_states(
    graph: SectionGraph, programs: Mapping[str, SectionPrograms], states: Mapping[str, SectionState]
) -> dict[str, SectionState]:
    """States by section, a staged section's stages joined into one `SectionState` whose
    optimizer state has the structure the section's optimizer gives its whole params."""
    staging = graph.staging
    if staging is None:
        return dict(states)
    out = {}
    for section in staging.whole.names:
        stages = staging.stages_of(section)
        if len(stages) == 1:
            out[section] = states[section]
            continue
        split = staging.splits[section]
        joined = merge_variables([states[s].variables for s in stages])
        opt = None
        if states[stages[0]].opt_state is not None:
            shape = jax.eval_shape(programs[stages[0]].optimizer.init, joined["params"])
            by_stage = [_leaves(states[s].opt_state) for s in stages]
            paths, treedef = jax.tree_util.tree_flatten_with_path(shape)
            leaves = []
            for path, _ in paths:
                owner = split.owner(_keys(path))
                leaves.append(by_stage[0 if owner is None else owner][jax.tree_util.keystr(path)])
            opt = jax.tree_util.tree_unflatten(treedef, leaves)
        out[section] = SectionState(joined["params"], joined["consts"], opt)
    return out


def stage_states(
    graph: SectionGraph, whole: Mapping[str, SectionState], like: Mapping[str, SectionState]
) -> dict[str, SectionState]:
    """`whole` (states by section) cut into the graph's stages; `like` (states by graph section,
    the current plan's) gives each stage's optimizer-state structure."""
    staging = graph.staging
    if staging is None:
        return dict(whole)
    out = {}
    for section, state in whole.items():
        stages = staging.stages_of(section)
        if len(stages) == 1:
            out[section] = state
            continue
        parts = split_variables(state.variables, staging.splits[section])
        opt = _leaves(state.opt_state) if state.opt_state is not None else None
        for s, v in zip(stages, parts):
            mine = None
            if opt is not None:
                paths, treedef = jax.tree_util.tree_flatten_with_path(like[s].opt_state)
                mine = jax.tree_util.tree_unflatten(
                    treedef, [_onto(opt[jax.tree_util.keystr(p)], x.sharding) for p, x in paths]
                )
            out[s] = SectionState(v["params"], v["consts"], mine)
    return out


# what a loader that restarts a staged section's optimizer gets for it: nothing yet; each stage's
# optimizer starts on the stage's own mesh once the section is cut again (`on_whole`)
_RESTART_PER_STAGE = types.SimpleNamespace(init_optimizer=lambda params: None)


def on_whole(
    graph: SectionGraph,
    programs: Mapping[str, SectionPrograms],
    states: Mapping[str, SectionState],
    load: Callable[[dict[str, SectionState], Mapping[str, object]], dict[str, SectionState]],
) -> dict[str, SectionState]:
    """`load(states, programs) -> states` (a Hugging Face loader, a start from another run's
    checkpoint) applied to the sections whole: a staged section's stages are joined for it and
    cut again after, each leaf staying on its own stage's devices. Where `load` restarts a staged
    section's optimizer (`programs[section].init_optimizer`), each stage's starts on its mesh."""
    if graph.staging is None:
        return load(dict(states), programs)
    joined = {**programs, **dict.fromkeys(graph.staging.splits, _RESTART_PER_STAGE)}
    cut = stage_states(graph, load(whole_states(graph, programs, states), joined), states)
    return {
        s: dataclasses.replace(st, opt_state=programs[s].init_optimizer(st.params))
        if st.opt_state is None and states[s].opt_state is not None
        else st
        for s, st in cut.items()
    }


def _onto(x: jax.Array, sharding) -> jax.Array:
    """`x` on `sharding`: a leaf no parameter owns (the update count) was restored once, onto
    the first stage's devices, and each other stage takes its copy device to device (a scalar
    as one element: transfers cut arrays along a first dimension)."""
    if x.sharding == sharding:
        return x
    return transfer(x.reshape(-1), sharding).reshape(x.shape) if x.ndim == 0 else transfer(x, sharding)
