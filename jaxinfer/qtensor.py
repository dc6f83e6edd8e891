"""Quantized weight formats: `Int4Weight` (W4A16, also 2/3-bit) and `Int8Weight` (W8A16, W8A8).

A quantized weight replaces a dense `[in, out]` leaf of the params pytree; `ops.linear`
dispatches on its type, so the model never branches on quantization. Both are registered pytree
dataclasses: arrays are data fields (they may carry a leading layer axis L, which `lax.scan`
slices away), sizes and flags are static fields, and the static `shape` is always the per-layer
`(in, out)`.

This module is a leaf: model, ops and quant all import it, and it imports only jax and the
Pallas-free nibble layout of `pallas_kernels.int4_matmul.reference`, which the kernel unpacks with
too, so the layout is written once.

Int4Weight semantics (the reference every kernel is tested against, see
`pallas_kernels/int4_matmul/`):

  packed [in/8, out] uint32   row 8r + j of q is nibble j of word r: (packed[r] >> 4j) & 0xF
  scales [in/G, out]          in the activation dtype
  zeros  [in/G, out] int32    integer zero points in 0 .. 2**bits - 1 (unpacked, one per group)
  perm   [in] int32 | None    act order: stored row k holds input feature perm[k]
  mins   [in/G, out] | None   float offsets, in the scales' dtype (GGUF Q4_1: w = d * q + m)
  w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] (+ mins[k // G, n])   in float32
  y = x[..., perm] @ w        (y = x @ w when perm is None)

`mins` is for formats whose offset is a float rather than an integer zero point (llama.cpp's
Q4_1 stores `d` and `m` per block of 32); with it the dequantization is bit for bit the `gguf`
library's `d * q + m` (zeros 0), so a GGUF file is served as stored, not re-quantized.

2- and 3-bit codes are stored in the same 4-bit containers (codes < 2**bits), so the kernel
consumes one layout. Per-channel quantization is `group_size == in`.

Int8Weight: `q [in, out]` int8, `scales [out]` float32, w = q * scales (symmetric, per output
channel). With `act_quant` (W8A8, SmoothQuant) activations are quantized per token at run time
and the product accumulates in int32; otherwise (W8A16) activations stay float. Grouped
(`group_size` G, W8A16 only; GGUF Q8_0 has G = 32): `scales [in/G, out]` float32 and
w[k, n] = q[k, n] * scales[k // G, n].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.int4_matmul.reference import pack_int4, unpack_int4

INT4_BITS = (2, 3, 4)  # codes stored in 4-bit containers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """A grouped 2/3/4-bit weight in 4-bit containers (see the module docstring)."""

    packed: jax.Array  # [(L,) in/8, out] uint32, 8 input rows per word, low nibble first
    scales: jax.Array  # [(L,) in/G, out] activation dtype
    zeros: jax.Array  # [(L,) in/G, out] int32 zero points in 0 .. 2**bits - 1
    perm: jax.Array | None  # [(L,) in] int32 act-order row permutation, or None
    group_size: int = dataclasses.field(metadata=dict(static=True))  # G; G == in: per channel
    bits: int = dataclasses.field(metadata=dict(static=True))  # 2, 3 or 4
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))  # per-layer (in, out)
    mins: jax.Array | None = None  # [(L,) in/G, out] scales' dtype: float offsets (Q4_1), or None

    def __post_init__(self):
        # Only static fields are checked: pytree unflattening may pass placeholders as arrays.
        check_int4_static(self.shape, self.group_size, self.bits)

    @property
    def act_dtype(self):
        """The activation dtype the weight dequantizes to (the scales' dtype)."""
        return self.scales.dtype

    @property
    def num_groups(self) -> int:
        return self.shape[0] // self.group_size

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The leading axes the arrays carry before the per-layer `(in, out)` (e.g. `(L,)`)."""
        return tuple(self.packed.shape[:-2])

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A symmetric int8 weight, per output channel (w = q * scales) or grouped along `in`."""

    q: jax.Array  # [(L,) in, out] int8
    scales: jax.Array  # [(L,) out] float32; grouped: [(L,) in/G, out]
    act_quant: bool = dataclasses.field(metadata=dict(static=True))  # True: W8A8, else W8A16
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))  # per-layer (in, out)
    # G rows of `in` share a scale (GGUF Q8_0: 32); None: one scale per output channel.
    group_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if len(self.shape) != 2:
            raise ValueError(f"Int8Weight shape={self.shape!r}; expected (in, out)")
        g = self.group_size
        if g is not None:
            if not isinstance(g, int) or g < 1 or self.shape[0] % g:
                raise ValueError(
                    f"Int8Weight group_size={g!r} must be a positive divisor of the input "
                    f"dimension {self.shape[0]}"
                )
            if self.act_quant:
                raise ValueError("a grouped Int8Weight is weight-only (W8A16): act_quant=False")

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The leading axes the arrays carry before the per-layer `(in, out)` (e.g. `(L,)`)."""
        return tuple(self.q.shape[:-2])

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnBlocks:
    """A weight-only quantized weight cut into blocks of `ob` output columns (the CPU layout).

    `blocks` is the weight itself (an `Int4Weight` or a grouped `Int8Weight`) with a leading
    block axis on each array, `[nb, ..., ob]`, and the per-block static shape `(in, ob)`; an
    act-order `perm` is held apart, since every block shares it. `ops.linear` applies it one
    block at a time (`lax.scan`), so only a `[in, ob]` block is ever dequantized at once; see
    `jaxinfer.transposed` for why (XLA on a CPU dequantizes a whole matrix in memory).
    """

    blocks: Int4Weight | Int8Weight  # arrays [nb, ..., ob]; static shape (in, ob)
    perm: jax.Array | None  # [in] int32 act-order permutation of the whole weight, or None
    out: int = dataclasses.field(metadata=dict(static=True))  # nb * ob

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.out)

    def whole(self) -> Int4Weight | Int8Weight:
        """The weight as one `[in, out]` pytree again (a copy)."""

        def join(a):  # [nb, r, ob] -> [r, nb * ob]
            return jnp.transpose(a, (1, 0, 2)).reshape(a.shape[1], self.out)

        return _with_perm(_map_out_arrays(self.blocks, join), self.shape, self.perm)


def column_blocks(w: Int4Weight | Int8Weight, ob: int) -> ColumnBlocks:
    """`w` (one layer's, 2-D arrays) cut into blocks of `ob` output columns; `ob` divides out."""
    d_in, d_out = w.shape
    if d_out % ob:
        raise ValueError(f"column_blocks: {ob} columns per block do not divide out = {d_out}")

    def cut(a):  # [r, out] -> [nb, r, ob], each block contiguous
        return jnp.transpose(a.reshape(a.shape[0], d_out // ob, ob), (1, 0, 2))

    blocks = _with_perm(_map_out_arrays(w, cut), (d_in, ob), None)
    return ColumnBlocks(blocks, getattr(w, "perm", None), d_out)


def _with_perm(w, shape: tuple[int, int], perm: jax.Array | None):
    """`w` with static shape `shape` and, for an Int4Weight, act order `perm`."""
    extra = {"perm": perm} if isinstance(w, Int4Weight) else {}
    return dataclasses.replace(w, shape=shape, **extra)


def _map_out_arrays(w, fn):
    """`w` with `fn` applied to its arrays that end in the output axis (not `perm`)."""
    fields = {}
    for f in dataclasses.fields(w):
        a = getattr(w, f.name)
        if f.name != "perm" and isinstance(a, jax.Array) and not f.metadata.get("static"):
            fields[f.name] = fn(a)
    return dataclasses.replace(w, **fields)


QUANTIZED_TYPES = (Int4Weight, Int8Weight)


def is_quantized(x) -> bool:
    """True for a quantized weight pytree (use as `is_leaf` when mapping over params)."""
    return isinstance(x, QUANTIZED_TYPES)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def check_int4_static(shape: tuple[int, int], group_size: int, bits: int) -> None:
    """Raises ValueError unless (shape, group_size, bits) describe a valid Int4Weight.

    Args:
      shape: the per-layer `(in, out)`.
      group_size: G; must divide `in` and be a multiple of 8 (a packed word never straddles
        two groups, which the kernel relies on).
      bits: 2, 3 or 4.
    """
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"Int4Weight shape={shape!r}; expected a positive (in, out)")
    if bits not in INT4_BITS:
        raise ValueError(
            f"bits={bits!r} is not supported for Int4Weight; expected one of {INT4_BITS}"
        )
    d_in = shape[0]
    if d_in % 8:
        raise ValueError(f"input dimension {d_in} must be a multiple of 8 to pack int4 rows")
    if not isinstance(group_size, int) or group_size < 8 or group_size % 8 or d_in % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be a multiple of 8 that divides the input "
            f"dimension {d_in} (use group_size={d_in} for per-channel)"
        )


def resolve_group_size(group_size: int | None, d_in: int) -> int:
    """None or -1 means per channel (G = in); anything else is returned unchanged."""
    return d_in if group_size in (None, -1) else group_size


# --------------------------------------------------------------------------------------------
# Packing (`pack_int4` / `unpack_int4`: the nibble layout of pallas_kernels, re-exported here)
# --------------------------------------------------------------------------------------------


def make_int4(
    q: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    bits: int,
    group_size: int,
    perm: jax.Array | None = None,
    mins: jax.Array | None = None,
) -> Int4Weight:
    """Builds an `Int4Weight` from unpacked codes, validating shapes.

    Args:
      q: `[..., in, out]` integer codes in 0 .. 2**bits - 1, rows in stored order.
      scales: `[..., in/G, out]` in the activation dtype.
      zeros: `[..., in/G, out]` integer zero points.
      bits: 2, 3 or 4.
      group_size: G.
      perm: optional `[..., in]` act-order permutation (stored row k is input feature perm[k]).
      mins: optional `[..., in/G, out]` float offsets added after scaling (cast to scales' dtype).

    Returns:
      The packed weight.
    """
    shape = tuple(q.shape[-2:])
    check_int4_static(shape, group_size, bits)
    want = (*q.shape[:-2], shape[0] // group_size, shape[1])
    for name, arr in (("scales", scales), ("zeros", zeros), ("mins", mins)):
        if arr is not None and tuple(arr.shape) != want:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected {want}")
    if perm is not None and tuple(perm.shape) != (*q.shape[:-2], shape[0]):
        raise ValueError(
            f"perm has shape {tuple(perm.shape)}; expected {(*q.shape[:-2], shape[0])}"
        )
    return Int4Weight(
        packed=pack_int4(q),
        scales=scales,
        zeros=zeros.astype(jnp.int32),
        perm=None if perm is None else perm.astype(jnp.int32),
        group_size=group_size,
        bits=bits,
        shape=shape,
        mins=None if mins is None else jnp.asarray(mins, scales.dtype),
    )


# --------------------------------------------------------------------------------------------
# Dequantization (the reference semantics)
# --------------------------------------------------------------------------------------------


def dequantize_rows(w: Int4Weight, dtype=None) -> jax.Array:
    """The Int4Weight in stored row order: `[..., in, out]`, computed in float32.

    Args:
      w: the weight.
      dtype: output dtype; defaults to the activation dtype (`w.scales.dtype`).

    Returns:
      `(q - z) * s (+ mins)` with rows in stored (possibly act-order permuted) order.
    """
    d_in, d_out = w.shape
    lead = w.packed.shape[:-2]
    ngroups = d_in // w.group_size
    q = unpack_int4(w.packed).reshape(*lead, ngroups, w.group_size, d_out)  # [.., g, G, out]
    z = w.zeros[..., :, None, :]  # [..., g, 1, out]
    s = w.scales.astype(jnp.float32)[..., :, None, :]  # [..., g, 1, out]
    deq = (q - z).astype(jnp.float32) * s  # [..., g, G, out]
    if w.mins is not None:
        deq = deq + w.mins.astype(jnp.float32)[..., :, None, :]  # [..., g, G, out]
    return deq.reshape(*lead, d_in, d_out).astype(dtype or w.scales.dtype)


def inverse_perm(perm: jax.Array) -> jax.Array:
    """`inv` with `inv[perm[k]] = k` (along the last axis)."""
    return jnp.argsort(perm, axis=-1).astype(jnp.int32)


def dequantize(w, dtype=None) -> jax.Array:
    """A quantized weight as a dense `[..., in, out]` array in the original input order.

    `x @ dequantize(w)` equals `linear(x, w)` for the weight-only formats: act-order rows are
    moved back (`w_orig[perm[k]] = w_stored[k]`).

    Args:
      w: an `Int4Weight` or `Int8Weight` (or a dense array, returned cast).
      dtype: output dtype; defaults to the activation dtype (Int4Weight: `scales.dtype`,
        Int8Weight: float32).

    Returns:
      The dense weight, computed in float32 and cast to `dtype`.
    """
    if isinstance(w, Int4Weight):
        rows = dequantize_rows(w, jnp.float32)
        if w.perm is not None:
            rows = jnp.take_along_axis(rows, inverse_perm(w.perm)[..., :, None], axis=-2)
        return rows.astype(dtype or w.scales.dtype)
    if isinstance(w, Int8Weight):
        if w.group_size is None:
            deq = w.q.astype(jnp.float32) * w.scales.astype(jnp.float32)[..., None, :]
        else:
            (d_in, d_out), lead = w.shape, w.lead_shape
            q = w.q.astype(jnp.float32).reshape(*lead, d_in // w.group_size, w.group_size, d_out)
            deq = q * w.scales.astype(jnp.float32)[..., :, None, :]  # [..., g, G, out]
            deq = deq.reshape(*lead, d_in, d_out)
        return deq.astype(dtype or jnp.float32)
    return jnp.asarray(w) if dtype is None else jnp.asarray(w).astype(dtype)


# --------------------------------------------------------------------------------------------
# Activation quantization (W8A8)
# --------------------------------------------------------------------------------------------


def quantize_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric dynamic int8 quantization of each token (row) of `x`.

    Args:
      x: `[..., in]` float activations.

    Returns:
      (`[..., in]` int8 codes, `[...]` float32 scales) with x ≈ codes * scale[..., None].
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)  # [...]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero row keeps scale 1
    q = jnp.clip(jnp.round(x32 / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale
