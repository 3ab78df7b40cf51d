"""Float8 (e4m3) weight matmuls: how a frozen section at `sections.<s>.precision: fp8` computes.

`maestro_jax.runtime.precision` stores each Dense kernel of such a section as an `Fp8Weight`:
its values in float8_e4m3fn and a float32 scale, the kernel being `value * scale`. The scale is
per tensor, amax / 448 (e4m3's largest finite value), computed once where the weights are made
(the section's init) or loaded (`models.hf`); a scanned stack's kernel has one per layer.

The models' Dense layers (`models.layers.Dense`, `models.layers.DenseGeneral`) take such a kernel
through two hooks Flax's layers offer, `promote_dtype` and `dot_general` (`fp8_dot`): each input
row is quantized to e4m3 with its own dynamic scale (its amax over the contracted axes / 448),
the product runs e4m3 x e4m3 with float32 accumulation (`jax.lax.dot_general(...,
preferred_element_type=float32)`), and the result is rescaled by both scales and returned in the
input's dtype (bfloat16 in an fp8 section). Any other kernel takes Flax's own path, so the same
layers run float32 and bfloat16 as before. A model built on plain `flax.linen.Dense` cannot take
an `Fp8Weight` and fails while tracing, saying so (`Fp8Weight.__jax_array__`).

The inputs' scales are per row rather than per tensor: a row's result then depends on that row
alone, not on the other rows of its micro-batch, so the sectioned step and the monolithic one
(which put different rows together) still differ by float rounding only, as at every other
precision; a per-tensor scale would move each sample's result with whichever samples share its
micro-batch, and would need a reduction across the data-parallel shards in every matmul.

XLA:CPU (jax 0.10.2) has no float8 matmul: it converts both e4m3 operands to float32 and runs a
float32 dot. Every e4m3 value is exact in float32, so the CPU multiplies the very operands an FP8
GEMM does and checks the quantization; it does not show the speed, nor a GPU's FP8 accumulator
keeping fewer bits than float32 (about 14 on Hopper's tensor cores, the DeepSeek-V3 technical
report finds).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448.0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["value", "scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A kernel stored in float8 e4m3: `value * scale` (`scale` broadcast over the trailing axes)."""

    value: Any  # float8_e4m3fn, the kernel's shape
    scale: Any  # float32, the kernel's leading `scale.ndim` axes: () for one tensor, [layers] for a scanned stack

    def __jax_array__(self):
        raise TypeError(
            "a float8 kernel (Fp8Weight, a frozen section at precision fp8) reached a layer that cannot take it: "
            "build the model's Dense layers as maestro_jax.models.layers.Dense / DenseGeneral (or pass "
            "promote_dtype=fp8.promote_dtype, dot_general=fp8.dot_general to flax's), or run the section in bfloat16"
        )


def _scale(amax, xp=jnp):
    """amax / 448, and 1 where amax is 0 (an all-zero tensor or row stays zeros, not NaNs)."""
    return xp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(xp.float32)


def quantize(w, stacked: int = 0) -> Fp8Weight:
    """`w` in e4m3 with a float32 scale per tensor; the first `stacked` axes index separate
    tensors (a scanned stack's layers), each scaled on its own. A NumPy array gives NumPy
    arrays (a checkpoint quantized on the host before it is placed), a JAX array JAX arrays."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    scale = _scale(xp.max(xp.abs(w32), axis=tuple(range(stacked, w32.ndim))), xp)
    return Fp8Weight((w32 / scale.reshape(scale.shape + (1,) * (w32.ndim - stacked))).astype(E4M3), scale)


def fp8_dot(x, w: Fp8Weight, dimension_numbers):
    """`x` (contracted over its axes named in `dimension_numbers`) times an e4m3 kernel: `x`
    quantized per row, an e4m3 x e4m3 product accumulated in float32, rescaled, in `x`'s dtype.
    The kernel's contracted axes are those `dimension_numbers` names; no batch axes."""
    (contract, _), (batch, _) = dimension_numbers
    if batch:
        raise ValueError(f"an fp8 kernel takes no batch dimensions; got {batch}")
    contract = tuple(a % x.ndim for a in contract)
    x32 = x.astype(jnp.float32)
    x_scale = _scale(jnp.max(jnp.abs(x32), axis=contract, keepdims=True))
    y = jax.lax.dot_general(  # DEFAULT whatever `jax.default_matmul_precision` says: e4m3 operands are exact
        (x32 / x_scale).astype(E4M3),
        w.value,
        dimension_numbers,
        precision=jax.lax.Precision.DEFAULT,
        preferred_element_type=jnp.float32,
    )
    row = jnp.squeeze(x_scale, contract)  # x's free axes, which lead y's
    return (y * row.reshape(row.shape + (1,) * (y.ndim - row.ndim)) * w.scale).astype(x.dtype)


def promote_dtype(inputs, kernel, bias, dtype=None, inexact=True):
    """Flax's `promote_dtype` for a Dense layer, an `Fp8Weight` kernel passed through as it is."""
    if not isinstance(kernel, Fp8Weight):
        return nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=dtype, inexact=inexact)
    inputs, bias = nn.dtypes.promote_dtype(inputs, bias, dtype=dtype, inexact=inexact)
    return inputs, kernel, bias


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general`, or `fp8_dot` where the kernel is an `Fp8Weight`."""
    if isinstance(rhs, Fp8Weight):
        return fp8_dot(lhs, rhs, dimension_numbers)
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    )
