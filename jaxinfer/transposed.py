"""`TransposedDense`: a dense `[in, out]` weight stored as its transpose `wt [out, in]`.

The CPU layout of the compiled decode loops and the engine (`model.params.cpu_layout`) stores
every dense projection this way, and `ops.linear` applies it by the number of rows it meets
(measured on XLA's CPU backend, SmolLM2-shaped weights, `experiments/linear_bench.py`):

  rows == 1 or > REDUCE_MAX_ROWS  dot_general contracting both last axes (a GEMV / an NT GEMM);
                                  at one row, `x @ w` where the weight keeps its `[in, out]`
                                  form too (`w`: the layout keeps it for the head, whose NT
                                  GEMV measured ~1.4x the NN one; the layers' measured equal)
  2 <= rows <= REDUCE_MAX_ROWS    a batched NT product over ROW_BLOCKS blocks of output rows,
                                  `einsum("mi,boi->bmo", x, wt.reshape(8, out / 8, in))` (where
                                  `out` divides; else a multiply and a sum over `in`, which XLA
                                  hands to YNNPACK as one pass over the weight for all rows). The
                                  NN GEMM that `x @ w` becomes at 2-16 rows costs 2-4x a GEMV, the
                                  sum ~1.3-2x; the blocked product took 0.89-0.93x the sum's
                                  whole SmolLM2 step at 2-8 rows and 0.95x at 16 (BENCHMARKS.md,
                                  2026-12-04 afternoon), the same weights read in the same order;
                                  above PAD_ABOVE rows, M is padded with zero rows to a multiple
                                  of PAD_ROWS (see below)

The bound is 16, not the 32 measured faster too (0.8x at 32 rows on SmolLM2): at 32 rows the
sum segfaulted inside XLA in an engine step of the tiny target (T = 1, 32 logits rows into the
head; `tests/server/test_bench_serve.py` ran it), though the same product alone ran at every row
count from 1 to 39. Rows above 16 take the NT GEMM, which the engine, `ji.generate` and the tests
ran before without a crash.

The blocked product's time is a staircase in M, not a line: a chain of SmolLM2's 30 layers'
four products took 18-20 ms at 1-4 rows, 27 at 5-7, 23 at 8, 34 at 9-12, 40 at 13-15 and 29.5
at 16 (an AMD EPYC with AVX-512, 2026-12-04 evening). So 5-7 rows are padded to 8 and 9-15 to
16: the zero rows cost less than the odd row count (BENCHMARKS.md). A γ = 4 verification is 5
rows; the engine pads its steps to power-of-two buckets anyway.

The sum (the fallback) has its operands pass through one `optimization_barrier` with the
weight, so XLA neither fuses the activation's producers into it nor shares (and so
materialises) the broadcast of one activation between the sibling projections that read it
(q/k/v, gate/up). The blocked product has no broadcast to share and needs no barrier.

A tied model's head is the embedding table itself (`[V, E]` is already `[out, in]`) beside the
`[E, V]` copy `inference_layout` materialises for one-row products, so the head costs no more
memory than there.

**Narrow weights.** XLA's CPU backend dequantizes a whole int8 or int4 matrix into a float32
copy in memory before each dot. One paged SmolLM2 step took 4.4x (W8A16), 4.6x (W4A16, groups of
32) and 5.6x (the GGUF file's Q4_1 / Q8_0 as stored) the float32 step at one row (BENCHMARKS.md,
2026-12-06). Inside `ji.generate`'s decode loop XLA hoists those dequantizations out of the loop
instead, so the loop read float32 copies of every weight (memory as float32 plus the narrow
copy), and the step table by format measured float32 under the formats' names.

Up to NARROW_SCAN_MAX_ROWS rows the product is therefore a `lax.scan` over blocks of
NARROW_BLOCK_ROWS output rows (or a divisor of `out`): each step dequantizes one `[block, in]`
block, which stays in cache, and multiplies it. Nothing loop-invariant is left for the decode
loop to hoist, so it reads the narrow bytes. W8A16 weights with one scale per output channel
are held here, `wt` int8 with its `scale` (fused like the dense ones); int4 and grouped int8
weights are held by `qtensor.ColumnBlocks` and applied the same way by `ops.linear`. The step at
one row took 1.19x the float32 step (W8A16), 1.84-1.94x (W4A16) and 2.4x (GGUF); at 2-16 rows
1.3-1.5x, where the whole-matrix dequantization took 2.0-3.9x. Above NARROW_SCAN_MAX_ROWS
(prefill), a dequantization is amortised over the rows: every block is dequantized at once.
On a GPU none of this applies: the loops keep the stored layout and the Pallas kernels.

Like the quantized formats, this module is a leaf: model and ops import it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

REDUCE_MAX_ROWS = 16  # see the module docstring: 32 rows crashed XLA in an engine step
ROW_BLOCKS = 8  # output-row blocks of the 2..REDUCE_MAX_ROWS product (0: the sum everywhere)
PAD_ROWS = 8  # the blocked product pads M above PAD_ABOVE to a multiple of this (0: no padding)
PAD_ABOVE = 4
NARROW_BLOCK_ROWS = 128  # output rows dequantized per step of a narrow product (or a divisor)
NARROW_SCAN_MAX_ROWS = REDUCE_MAX_ROWS  # above: the whole narrow matrix is dequantized at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedDense:
    """A dense weight `w [in, out]` held as `wt = w.T`, `[out, in]` (rows are output features).

    With `scale`, `wt` is int8 and the weight is `wt.T * scale`: a per-output-channel W8A16
    weight (`qtensor.Int8Weight`) in this layout, applied as the dense one and scaled after the
    reduction, as `ops.linear` applies an Int8Weight.
    """

    wt: jax.Array  # [out, in]
    w: jax.Array | None = None  # [in, out] as well, or None: the one-row product's operand
    scale: jax.Array | None = None  # [out] float32: wt is int8 (W8A16), the weight wt.T * scale

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's `(in, out)`, as a dense `[in, out]` leaf reports it."""
        return (self.wt.shape[1], self.wt.shape[0])

    @property
    def dtype(self):
        return self.wt.dtype

    def dense(self) -> jax.Array:
        """The weight as `[in, out]` (a transposed copy; float32 if int8 with a scale)."""
        if self.scale is not None:
            return jnp.swapaxes(self.wt.astype(jnp.float32) * self.scale[:, None], -1, -2)
        return jnp.swapaxes(self.wt, -1, -2)


def transpose_dense(w: jax.Array, keep: bool = False) -> TransposedDense:
    """A dense `[in, out]` weight -> `TransposedDense` holding a contiguous `[out, in]` copy
    (and, with `keep`, `w` itself for one-row products)."""
    if w.ndim != 2:
        raise ValueError(f"transpose_dense takes a 2-D [in, out] weight, got shape {w.shape}")
    return TransposedDense(jnp.asarray(w.T), w if keep else None)


def apply(x: jax.Array, w: TransposedDense) -> jax.Array:
    """`x @ w` for x `[..., in]` -> float32 `[..., out]` (see the module docstring)."""
    if w.scale is not None:
        return _apply_int8(x, w)
    wt = w.wt.astype(x.dtype)  # [out, in]
    if wt.ndim != 2 or x.shape[-1] != wt.shape[1]:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] against a weight of shape {w.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    m = x2.shape[0]
    if m == 1 and w.w is not None:
        y = jnp.dot(x2, w.w.astype(x.dtype), preferred_element_type=jnp.float32)  # [1, out]
    elif 2 <= m <= REDUCE_MAX_ROWS and x.dtype == jnp.float32:
        out, k = wt.shape
        if ROW_BLOCKS and out % ROW_BLOCKS == 0:
            blocks = wt.reshape(ROW_BLOCKS, out // ROW_BLOCKS, k)  # [nb, out / nb, in]
            mp = -(-m // PAD_ROWS) * PAD_ROWS if PAD_ROWS and m > PAD_ABOVE else m
            if mp != m:
                x2 = jnp.pad(x2, ((0, mp - m), (0, 0)))  # [Mp, in], zero rows appended
            y = jnp.einsum("mi,boi->bmo", x2, blocks, preferred_element_type=jnp.float32)
            y = jnp.transpose(y, (1, 0, 2)).reshape(mp, out)[:m]  # [nb, Mp, out / nb] -> [M, out]
        else:
            x2, wt = jax.lax.optimization_barrier((x2, wt))
            y = jnp.sum(wt[:, None, :] * x2[None, :, :], axis=-1).T  # [out, M] -> [M, out]
    else:
        y = jax.lax.dot_general(
            x2, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, out]
    return y.reshape(*lead, wt.shape[0])


def column_block(out: int) -> int:
    """The output rows (columns of `[in, out]`) per scan step of a narrow weight's product: the
    largest of NARROW_BLOCK_ROWS and its halves down to 8 that divides `out` (0: none does)."""
    b = NARROW_BLOCK_ROWS
    while b >= 8 and out % b:
        b //= 2
    return b if b >= 8 else 0


def scan_blocks(product, blocks) -> jax.Array:
    """`[M, out]`: `product(block) -> [M, ob]` for each block of `blocks` (a pytree whose arrays
    lead with the block axis `nb`) in turn, one `lax.scan` step each, joined in block order
    (`out = nb * ob`). The narrow products' loop: only one block is dequantized at a time."""
    _, ys = jax.lax.scan(lambda _, b: (None, product(b)), None, blocks)  # [nb, M, ob]
    nb, m, ob = ys.shape
    return jnp.transpose(ys, (1, 0, 2)).reshape(m, nb * ob)


def _apply_int8(x: jax.Array, w: TransposedDense) -> jax.Array:
    """`x @ (wt.T * scale)` for an int8 `wt [out, in]` (see the module docstring)."""
    out, k = w.wt.shape
    if w.wt.ndim != 2 or x.shape[-1] != k:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] against a weight of shape {w.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, in]
    nt = (((1,), (1,)), ((), ()))  # contract both `in` axes
    ob = column_block(out)
    if x2.shape[0] <= NARROW_SCAN_MAX_ROWS and ob:

        def block(wb):  # [ob, in] int8 -> [M, ob]; only this block is converted
            return jax.lax.dot_general(
                x2, wb.astype(x.dtype), nt, preferred_element_type=jnp.float32
            )

        y = scan_blocks(block, w.wt.reshape(out // ob, ob, k))  # [M, out]
    else:
        y = jax.lax.dot_general(x2, w.wt.astype(x.dtype), nt, preferred_element_type=jnp.float32)
    return (y * w.scale.astype(jnp.float32)).reshape(*lead, out)
