"""Each trained section's optax optimizer, and clipping by the global gradient norm over ALL of them.

Sections live on different meshes, so one `optax.clip_by_global_norm` over the model cannot
run. Instead each section reduces its gradients' squared norm on its own mesh
(`squared_norm`), every section's update receives all of those scalars (moved to its mesh;
`runtime.executor.Executor.update`), sums them in one fixed order (sorted section names) and
scales its gradients by optax's clipping factor (`clip`) before its own optimizer. The monolithic
step does the same on one mesh (`runtime.monolithic.Monolithic.update`), so the two clip alike
to float rounding, and both equal what one optimizer over the whole model would do.

Freezing (`optimizer.sections.<s>.freeze`, regexes over parameter paths): the frozen parameters
go to `optax.set_to_zero` through `optax.multi_transform`, so the optimizer proper never sees
them (no update, no weight decay, no moments), and `squared_norm` leaves them out, so the clip
norm is the norm over the parameters that train, as if the frozen ones were constants. Their
gradients are still computed (the backward runs through them to reach what trains below).

The learning rate is injected (`optax.inject_hyperparams`): the rate each update used is in the
optimizer state, where the training loop reads it for the metrics.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from maestro_jax.config import ConfigError, LRScheduleConfig, OptimizerConfig


def learning_rate(peak: float, sched: LRScheduleConfig, steps: int, section: str) -> optax.Schedule:
    """The rate by applied update: optax's own schedule (`warmup_cosine_decay_schedule`, or its
    linear and constant counterparts: a warm-up from 0 over `warmup_steps`, then `peak` held or
    decayed to `final_fraction` of it by `decay_steps`, default `steps`, the run's length,
    warm-up included) read at the update's number counted from 1. So the first warm-up update
    uses `peak / warmup_steps` (none is wasted at rate 0), the `warmup_steps`-th uses `peak`, once,
    and update `decay_steps` uses the final rate. `inject_hyperparams` evaluates a schedule at the
    count of updates already applied, hence the shift by one."""
    warmup, end = sched.warmup_steps, sched.decay_steps or steps
    if sched.kind != "constant" and end <= warmup:
        where = f"optimizer.sections.{section}.lr_schedule" if section else "optimizer.lr_schedule"
        raise ConfigError(
            f"error: {where}.decay_steps={end}: the decay must end after the {warmup} warm-up "
            f"steps (decay_steps counts them; unset, it is the run's steps)"
        )
    final = peak * sched.final_fraction
    if sched.kind == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, end, final)
    else:
        after = (
            optax.constant_schedule(peak)
            if sched.kind == "constant"
            else optax.linear_schedule(peak, final, end - warmup)
        )
        schedule = (
            optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup]) if warmup else after
        )
    return lambda count: schedule(count + 1)


def _decayed(params):
    """Weight decay by role: every parameter but biases (`bias`, `conv1_bias`, ...) and norms'
    scales (`scale`), whatever their rank (Qwen2's and the towers' `[heads, head_dim]` attention
    biases included)."""

    def role(path, _):
        name = str(path[-1].key) if isinstance(path[-1], jax.tree_util.DictKey) else ""
        return not (name == "scale" or name == "bias" or name.endswith("_bias"))

    return jax.tree_util.tree_map_with_path(role, params)


def _sgd(learning_rate, weight_decay, mask, freeze):
    return _freezing(optax.chain(optax.add_decayed_weights(weight_decay, mask), optax.sgd(learning_rate)), freeze)


def _adamw(learning_rate, b1, b2, eps, weight_decay, mask, freeze):
    return _freezing(optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay, mask=mask), freeze)


def param_path(path) -> str:
    """A parameter's path as `freeze` patterns read it: its dict keys joined by "/"
    (`block_0/attn/q/kernel`); flax's partitioning boxes add nothing."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _frozen(freeze: Sequence[str]) -> Callable[[str], bool]:
    compiled = [re.compile(p) for p in freeze]
    return lambda path: any(c.fullmatch(path) for c in compiled)


def _freezing(tx: optax.GradientTransformation, freeze: tuple[str, ...]) -> optax.GradientTransformation:
    """`tx` for the parameters no `freeze` pattern matches; zero updates (and no state) for the rest."""
    if not freeze:
        return tx
    frozen = _frozen(freeze)

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if frozen(param_path(path)) else "trained", params
        )

    return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)


def section_optimizer(cfg: OptimizerConfig, section: str, steps: int) -> optax.GradientTransformation:
    """`section`'s optimizer, its overrides applied (`OptimizerConfig.for_section`) and its
    frozen parameters left out."""
    peak, sched, decay = cfg.for_section(section)
    lr = learning_rate(peak, sched, steps, section if section in cfg.sections else "")
    mask = _decayed if cfg.decay == "matrices" else None
    freeze = _freeze_of(cfg, section)
    # only the rate is injected: the rest stay Python floats, as optax.adamw takes them (injected,
    # they would be float32 arrays, and 1 - b2 would round differently from optax's own)
    if cfg.name == "sgd":
        return optax.inject_hyperparams(_sgd, static_args=("weight_decay", "mask", "freeze"))(
            learning_rate=lr, weight_decay=decay, mask=mask, freeze=freeze
        )
    return optax.inject_hyperparams(_adamw, static_args=("b1", "b2", "eps", "weight_decay", "mask", "freeze"))(
        learning_rate=lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=decay, mask=mask, freeze=freeze
    )


def _freeze_of(cfg: OptimizerConfig, section: str) -> tuple[str, ...]:
    own = cfg.sections.get(section)
    return tuple(own.freeze) if own is not None else ()


def section_squared_norm(cfg: OptimizerConfig, section: str) -> Callable:
    """`squared_norm` over `section`'s gradients, its frozen parameters left out."""
    return functools.partial(squared_norm, freeze=_freeze_of(cfg, section))


def check_sections(cfg: OptimizerConfig, trained: Sequence[str], params: Mapping[str, object] | None = None) -> None:
    """Per-section settings name trained sections, and each `freeze` pattern matches some of the
    section's parameters in `params` (section -> its params tree, abstract will do), before any compute."""
    for name in cfg.sections:
        if name not in trained:
            raise ConfigError(
                f"error: optimizer.sections.{name}: not a trained section of this graph; trained "
                f"sections: {', '.join(sorted(trained))}"
            )
    for name, own in cfg.sections.items():
        if params is None or not own.freeze:
            continue
        paths = [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params[name])]
        for pattern in own.freeze:
            if not any(_frozen([pattern])(p) for p in paths):
                shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
                raise ConfigError(
                    f"error: optimizer.sections.{name}.freeze={pattern!r}: matches no parameter of section "
                    f"{name!r} (the whole path must match); its {len(paths)} parameters: {shown}"
                )


def squared_norm(tree, freeze: tuple[str, ...] = ()) -> jax.Array:
    """Sum of squares of every element of `tree` but the parameters `freeze` matches, in float32,
    as a 1-element array (what the cross-mesh transfers move: they cut arrays along a first dimension)."""
    frozen = _frozen(freeze)
    kept = [x.astype(jnp.float32) for p, x in jax.tree_util.tree_leaves_with_path(tree) if not frozen(param_path(p))]
    total = optax.tree_utils.tree_norm(kept, squared=True) if kept else jnp.zeros((), jnp.float32)  # all frozen: 0.0
    return jnp.reshape(total, (1,))


def clip(grads, norms_sq: Sequence[jax.Array], max_norm: float):
    """`grads` scaled as `optax.clip_by_global_norm(max_norm)` scales them, the global norm taken
    over every section's squared norm in `norms_sq` (summed in the order given)."""
    norm = jnp.sqrt(sum(norms_sq))[0]
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm), grads)


def update_fn(optimizer: optax.GradientTransformation, clip_norm: float | None) -> Callable:
    """The update program's body: clip (when `clip_norm` and the norms are given), then the optimizer."""

    def update(params, opt_state, grads, norms_sq=()):
        if clip_norm is not None and norms_sq:
            grads = clip(grads, norms_sq, clip_norm)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def current_rate(opt_state) -> jax.Array:
    """The learning rate the last update used (`inject_hyperparams` keeps it in the state)."""
    return opt_state.hyperparams["learning_rate"]
