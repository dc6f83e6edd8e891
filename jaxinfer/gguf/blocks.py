"""GGUF Q4_0 / Q4_1 / Q8_0 blocks as jaxinfer's `Int4Weight` / grouped `Int8Weight`, as stored.

A block covers 32 consecutive inputs of one output row (ggml's `ne0` axis is a linear's `in`):

  Q4_0  d f16 | qs[16]        w = (q - 8) · d        q = qs & 0xF (j < 16), qs >> 4 (j >= 16)
  Q4_1  d f16 | m f16 | qs[16]  w = q · d + m
  Q8_0  d f16 | qs[32] int8   w = q · d

so a block is one group (G = 32) of an `[in, out]` weight: the codes are repacked into
jaxinfer's nibble layout and `d`, `m` become the group's scale and offset, exactly (float16 ->
float32). With the zero point 8 (Q4_0) or 0 plus `mins` (Q4_1), `qtensor.dequantize` computes
the gguf library's float32 values bit for bit. Only the layout changes, never a value.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.qtensor import Int4Weight, Int8Weight

GROUP = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
# By name: comparing `tensor_type.name` keeps the gguf library unimported until a file is read.
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_SHIFTS = (4 * np.arange(8, dtype=np.uint32))[:, None]  # [8, 1] nibble j at bits 4j


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's q/k permutation on the output rows of `w [out, ...]`.

    ggml's RoPE rotates adjacent pairs (2i, 2i+1) of a head; HF's rotates (i, i + D/2). The
    converter reorders each head's rows as `reshape(H, 2, D/2).swapaxes(1, 2)`; this is its
    inverse, `reshape(H, D/2, 2).swapaxes(1, 2)`.
    """
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def split_blocks(t) -> dict[str, np.ndarray]:
    """The fields of a Q4_0 / Q4_1 / Q8_0 reader tensor, per output row and block.

    Returns:
      {"q": `[out, in]` codes (uint8 0..15, or int8), "d": `[out, in/32]` float32, and for Q4_1
      "m": `[out, in/32]` float32}.
    """
    d_in, d_out = (int(n) for n in t.shape)
    raw = np.asarray(t.data, np.uint8).reshape(d_out, d_in // GROUP, -1)  # [out, nb, bytes]
    fields = {"d": raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)}
    if t.tensor_type.name == "Q8_0":
        q = raw[..., 2:34].copy().view(np.int8)  # [out, nb, 32]
    else:
        start = 2
        if t.tensor_type.name == "Q4_1":
            fields["m"] = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            start = 4
        qs = raw[..., start : start + 16]  # [out, nb, 16]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [out, nb, 32]: low nibbles first
    fields["q"] = q.reshape(d_out, d_in)
    return fields


def _pack(q: np.ndarray) -> np.ndarray:
    """`[..., in, out]` codes 0..15 -> `[..., in/8, out]` uint32 (qtensor's nibble layout)."""
    *lead, d_in, d_out = q.shape
    words = q.astype(np.uint32).reshape(*lead, d_in // 8, 8, d_out) << _SHIFTS
    return np.bitwise_or.reduce(words, axis=-2)  # [..., in/8, out]


def stacked_quantized(tensors, dtype, permute_heads=None, *, stacked: bool = True):
    """One jaxinfer quantized weight from GGUF tensors of one leaf, or None if it cannot be kept.

    Args:
      tensors: reader tensors of one linear (one per layer), each `ne = (in, out)`.
      dtype: the activation dtype, for the int4 scales and mins (float32 / float16 hold the
        float16 block scales exactly).
      permute_heads: head count of a llama q/k projection: its output rows are unpermuted
        (`unpermute_rows`), which moves whole rows, so the blocks stay intact.
      stacked: stack the layers on a leading axis (False: a single tensor, no layer axis).

    Returns:
      An `Int4Weight` (Q4_0, Q4_1) or a grouped W8A16 `Int8Weight` (Q8_0), or None when the
      tensors are not all of one of these types.
    """
    qtype = tensors[0].tensor_type.name
    if qtype not in KEPT_TYPES or any(t.tensor_type.name != qtype for t in tensors):
        return None
    per_layer = []
    for t in tensors:
        fields = split_blocks(t)
        if permute_heads is not None:
            fields = {k: unpermute_rows(v, permute_heads) for k, v in fields.items()}
        per_layer.append({k: v.T for k, v in fields.items()})  # [in, out], [in/32, out]
    arrays = {
        k: np.stack([f[k] for f in per_layer]) if stacked else per_layer[0][k] for k in per_layer[0]
    }
    d_in, d_out = (int(n) for n in tensors[0].shape)
    if qtype == "Q8_0":
        return Int8Weight(
            q=jnp.asarray(arrays["q"]),
            scales=jnp.asarray(arrays["d"]),  # float32, exact
            act_quant=False,
            shape=(d_in, d_out),
            group_size=GROUP,
        )
    zero = 8 if qtype == "Q4_0" else 0
    return Int4Weight(
        packed=jnp.asarray(_pack(arrays["q"])),
        scales=jnp.asarray(arrays["d"], dtype),
        zeros=jnp.full(arrays["d"].shape, zero, jnp.int32),
        perm=None,
        group_size=GROUP,
        bits=4,
        shape=(d_in, d_out),
        mins=jnp.asarray(arrays["m"], dtype) if "m" in arrays else None,
    )
