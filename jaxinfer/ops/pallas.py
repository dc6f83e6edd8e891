"""The Pallas backend of the ops: the kernels of `pallas_kernels`, adapted to the ops' arguments.

Only the dispatch paths that resolve to a "pallas" backend import this module (from inside
`linear` and `paged_attention`), so `import jaxinfer` and every XLA run never load Pallas or
Triton: this is the one place jaxinfer reaches a `kernel.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.distributed.kernels import attention_over_heads
from jaxinfer.qtensor import Int4Weight, Int8Weight, quantize_per_token
from pallas_kernels.int4_matmul.kernel import int4_matmul
from pallas_kernels.int8_matmul.kernel import int8_int8_matmul, int8_matmul
from pallas_kernels.paged_attention.kernel import ragged_paged_attention


def linear(x: jax.Array, w: Int4Weight | Int8Weight, *, interpret: bool) -> jax.Array:
    """`x [..., in] @ w` through the quantized matmul kernels; `[..., out]` float32.

    The same products as the XLA path of `ops.linear`, computed on tiles (the weight is read once,
    as stored).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if isinstance(w, Int4Weight):
        y = int4_matmul(
            x2, w.packed, w.scales.astype(x.dtype), w.zeros,
            group_size=w.group_size, perm=w.perm, interpret=interpret,
            mins=None if w.mins is None else w.mins.astype(x.dtype),
        )  # fmt: skip
    elif w.act_quant:
        xq, xs = quantize_per_token(x2)  # [M, in] int8, [M] float32
        y = int8_int8_matmul(xq, xs, w.q, w.scales, interpret=interpret)
    else:
        y = int8_matmul(x2, w.q, w.scales, interpret=interpret)
    return y.astype(jnp.float32).reshape(*lead, y.shape[-1])


def paged_attention(*args, interpret: bool, **kwargs) -> jax.Array:
    """`ragged_paged_attention` (same arguments as `ops.paged_attention`).

    A pallas_call is not partitioned by XLA: under a TP mesh it runs per device on its heads.
    """
    kernel = functools.partial(ragged_paged_attention, interpret=interpret)
    return attention_over_heads(kernel, *args, **kwargs)
