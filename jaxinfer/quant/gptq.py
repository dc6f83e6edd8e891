"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), Algorithm 1 with lazy batch updates, as pure jitted JAX.

Orientation: the paper's W is `[out, in]` and it sweeps *columns* (input features). Our weights
are `[in, out]`, so the same sweep runs over *rows*; "column i" of the paper is row i here.

  H     = 2 X Xᵀ / T, the Hessian of ‖XW − XŴ‖² over T calibration tokens          [in, in]
  damp  : H += damp · mean(diag H) · I  (dead inputs, diag 0, get H[i, i] = 1 first)
  Hinv  = upper Cholesky factor of H⁻¹ (H⁻¹ = Hinvᵀ Hinv, as in the paper)          [in, in]
  sweep : for each row i (in blocks of `blocksize`):
            q_i = quant(w_i);  e_i = (w_i − q_i) / Hinv[i, i]
            w_j −= Hinv[i, j] · e_i  for the rows j > i of the block (eagerly)
          after each block, the rows after it get the block's errors at once (lazy update).

Groups: without act order, a group's grid is fixed when the sweep reaches its first row, from the
weights as updated so far (exactly the column-by-column algorithm; the block size is a multiple
of G so a group never straddles a pending lazy update). With `act_order` the rows are swept in
order of decreasing diag(H); with `static_groups` (default) the grids are fixed from the ORIGINAL
weights before the sweep, so the codes can be stored in the original row order and the kernel
needs no permutation. With `static_groups=False` groups are formed in the permuted order and the
weight stores its rows permuted, with `perm` (stored row k = input feature perm[k]).
Dead inputs keep their weights (the reference zeroes them): they are rounded without feedback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.qtensor import (
    Int4Weight,
    check_int4_static,
    make_int4,
    resolve_group_size,
)
from jaxinfer.quant.rtn import group_params, quantize_codes, rtn_params
from jaxinfer.quant.stats import relative_error

_HI = lax.Precision.HIGHEST  # no TF32 on GPUs: the sweep feeds its own rounding errors back
_SINGULAR_TOL = 1e-6  # a Cholesky pivot² below this fraction of mean(diag H) counts as singular


def hessian(x: jax.Array) -> jax.Array:
    """H = 2 XᵀX / T of the calibration inputs of a linear layer.

    Args:
      x: `[..., in]` activations (all leading axes are tokens).

    Returns:
      `[in, in]` float32. Raises ValueError for empty or non-finite concrete inputs.
    """
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [T, in]
    check_calibration(x, "hessian input")
    return 2.0 * jnp.dot(x.T, x, precision=_HI) / x.shape[0]


def check_calibration(x: jax.Array, name: str) -> None:
    """Raises ValueError when concrete calibration data `x` is empty or not finite."""
    if x.size == 0:
        raise ValueError(f"{name}: calibration data is empty (shape {tuple(x.shape)})")
    if not isinstance(x, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(x))):
        raise ValueError(f"{name}: calibration data contains NaN or Inf")


def _pick_blocksize(n: int, blocksize: int, step: int) -> int:
    """Largest multiple of `step` dividing n and at most max(blocksize, step)."""
    cap = max(blocksize, step)
    return max(b for b in range(step, n + 1, step) if n % b == 0 and b <= cap)


def _hinv_factor(H: jax.Array, damp: float) -> tuple[jax.Array, jax.Array]:
    """Dampens H and returns (upper Cholesky factor of H⁻¹ `[in, in]`, singular flag)."""
    n = H.shape[0]
    eye = jnp.eye(n, dtype=jnp.float32)
    mean_diag = jnp.mean(jnp.diagonal(H))
    H = H + damp * mean_diag * eye
    L = jnp.linalg.cholesky(H)  # lower; NaN when H is not positive definite
    pivots = jnp.diagonal(L)
    singular = ~jnp.all(jnp.isfinite(L)) | (jnp.min(pivots) ** 2 <= _SINGULAR_TOL * mean_diag)
    H_inv = jax.scipy.linalg.cho_solve((L, True), eye)  # H⁻¹
    H_inv = 0.5 * (H_inv + H_inv.T)
    Hinv = jnp.linalg.cholesky(H_inv).T  # upper: H⁻¹ = Hinvᵀ Hinv, Hinv[i, j] = 0 for j < i
    singular |= ~jnp.all(jnp.isfinite(Hinv))
    return jnp.where(singular, jnp.eye(n, dtype=jnp.float32), Hinv), singular


def _sweep(W, Hinv, *, bits, sym, group_size, blocksize, scale_dtype, fixed):
    """The GPTQ row sweep. W `[n, m]` rows in sweep order; Hinv `[n, n]` upper factor of H⁻¹.

    `fixed` is None (grids formed at each group's first row) or (S_tab `[g, m]`, Z_tab `[g, m]`,
    gidx `[n]`): the grid of row k is group gidx[k] of the tables.
    Returns codes `[n, m]` int32 and, for the dynamic case, the grids `[n/G, m]`.
    """
    n, m = W.shape
    G, B = group_size, blocksize
    S = jnp.ones((n // G, m), jnp.float32)
    Z = jnp.zeros((n // G, m), jnp.int32)

    def block(b, carry):
        W, Q, S, Z = carry
        i1 = b * B
        W1 = lax.dynamic_slice_in_dim(W, i1, B, 0)  # [B, m]
        Hinv1 = lax.dynamic_slice(Hinv, (i1, i1), (B, B))  # [B, B]

        def row(i, c):
            W1, Q1, E1, S, Z, s, z = c
            k = i1 + i
            if fixed is None:
                grp = lax.dynamic_slice_in_dim(W1, i, G, 0)  # [G, m], used at a group start
                s_new, z_new = group_params(grp, bits=bits, sym=sym, scale_dtype=scale_dtype)
                start = k % G == 0
                s, z = jnp.where(start, s_new, s), jnp.where(start, z_new, z)  # [m]
                S = lax.dynamic_update_index_in_dim(S, s, k // G, 0)
                Z = lax.dynamic_update_index_in_dim(Z, z, k // G, 0)
            else:
                S_tab, Z_tab, gidx = fixed
                s, z = S_tab[gidx[k]], Z_tab[gidx[k]]  # [m]
            w = lax.dynamic_index_in_dim(W1, i, 0, keepdims=False)  # [m]
            q = quantize_codes(w, s, z, bits)  # [m]
            e = (w - (q - z).astype(jnp.float32) * s) / Hinv1[i, i]  # [m]
            W1 = W1 - Hinv1[i][:, None] * e[None, :]  # rows j >= i; Hinv1[i, j < i] = 0
            Q1 = lax.dynamic_update_index_in_dim(Q1, q, i, 0)
            E1 = lax.dynamic_update_index_in_dim(E1, e, i, 0)
            return W1, Q1, E1, S, Z, s, z

        init = (
            W1,
            jnp.zeros((B, m), jnp.int32),
            jnp.zeros((B, m), jnp.float32),
            S,
            Z,
            jnp.ones((m,), jnp.float32),
            jnp.zeros((m,), jnp.int32),
        )
        _, Q1, E1, S, Z, _, _ = lax.fori_loop(0, B, row, init)
        Q = lax.dynamic_update_slice_in_dim(Q, Q1, i1, 0)
        # Lazy update of every later row at once: W[j] -= sum_i Hinv[i, j] e_i (zero for j < i1).
        W = W - jnp.dot(lax.dynamic_slice_in_dim(Hinv, i1, B, 0).T, E1, precision=_HI)  # [n, m]
        return W, Q, S, Z

    Q = jnp.zeros((n, m), jnp.int32)
    _, Q, S, Z = lax.fori_loop(0, n // B, block, (W, Q, S, Z))
    return Q, S, Z


@functools.partial(
    jax.jit,
    static_argnames=(
        "bits",
        "group_size",
        "sym",
        "damp",
        "act_order",
        "static_groups",
        "blocksize",
        "scale_dtype",
    ),
)
def gptq_core(
    w, H, *, bits, group_size, sym, damp, act_order, static_groups, blocksize, scale_dtype
):
    """Jitted GPTQ on validated inputs: (Int4Weight, relative error, singular flag).

    See `gptq_quantize` for the arguments; `group_size` is already resolved to an int.
    """
    n, m = w.shape
    G = group_size
    scale_dtype = jnp.dtype(scale_dtype)
    W = w.astype(jnp.float32)  # [n, m]
    H = H.astype(jnp.float32)  # [n, n]
    H_orig = H
    dead = jnp.diagonal(H) == 0
    H = H + jnp.diag(dead.astype(jnp.float32))
    perm = jnp.argsort(-jnp.diagonal(H)).astype(jnp.int32) if act_order else None  # [n]

    # Grids fixed before the sweep: per channel (G = n) or act order with static groups.
    fixed_grids = G == n or (act_order and static_groups)
    if fixed_grids:
        S_tab, Z_tab = rtn_params(W, bits=bits, group_size=G, sym=sym, scale_dtype=scale_dtype)
        gidx = (jnp.arange(n) if perm is None else perm) // G  # [n] group of each swept row
        fixed = (S_tab, Z_tab, gidx)
        B = _pick_blocksize(n, blocksize, 1)
    else:
        fixed = None
        B = _pick_blocksize(n, blocksize, G)

    if perm is not None:
        W, H = W[perm], H[perm][:, perm]
    Hinv, singular = _hinv_factor(H, damp)
    Q, S, Z = _sweep(
        W, Hinv, bits=bits, sym=sym, group_size=G, blocksize=B, scale_dtype=scale_dtype, fixed=fixed
    )
    if fixed_grids:
        S, Z = S_tab, Z_tab
        if perm is not None:
            Q = jnp.zeros_like(Q).at[perm].set(Q)  # back to the original row order
        stored_perm = None
    else:
        stored_perm = perm  # rows (and groups) stay in sweep order
    qw = make_int4(Q, S.astype(scale_dtype), Z, bits=bits, group_size=G, perm=stored_perm)

    return qw, relative_error(H_orig, w, qw), singular


def gptq_quantize(
    w: jax.Array,
    H: jax.Array,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    sym: bool = False,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = True,
    blocksize: int = 128,
    scale_dtype=None,
    name: str = "weight",
) -> tuple[Int4Weight, jax.Array]:
    """Quantizes one linear weight with GPTQ.

    Args:
      w: `[in, out]` dense weight.
      H: `[in, in]` Hessian of its inputs (`hessian(x)`, or a sum of such).
      bits: 2, 3 or 4.
      group_size: G dividing `in` (multiple of 8); None or -1 for per-channel.
      sym: symmetric grids.
      damp: dampening, as a fraction of the mean diagonal of H.
      act_order: sweep the rows in order of decreasing diag(H).
      static_groups: with act order, fix the grids from the original weights (no stored perm).
      blocksize: rows per lazy-update block (rounded to a multiple of G dividing `in`).
      scale_dtype: dtype of the stored scales; defaults to w's dtype.
      name: names the layer in error messages.

    Returns:
      (the `Int4Weight`, relative reconstruction error ‖X(W − Ŵ)‖² / ‖XW‖² on the inputs of H).
      Raises ValueError for bad arguments, a non-finite H, or an H that stays singular after
      dampening.
    """
    if w.ndim != 2 or tuple(H.shape) != (w.shape[0], w.shape[0]):
        raise ValueError(
            f"{name}: w has shape {tuple(w.shape)} and H {tuple(H.shape)}; expected w [in, out] "
            f"and H [in, in]"
        )
    group_size = resolve_group_size(group_size, w.shape[0])
    check_int4_static(tuple(w.shape), group_size, bits)
    if not (damp >= 0) or blocksize < 1:
        raise ValueError(f"{name}: damp={damp!r} must be >= 0 and blocksize={blocksize!r} >= 1")
    concrete = not isinstance(H, jax.core.Tracer)
    if concrete and not bool(jnp.all(jnp.isfinite(H))):
        raise ValueError(f"{name}: the Hessian contains NaN or Inf (non-finite calibration data)")
    qw, rel_err, singular = gptq_core(
        w,
        H,
        bits=bits,
        group_size=group_size,
        sym=sym,
        damp=float(damp),
        act_order=act_order,
        static_groups=static_groups,
        blocksize=blocksize,
        scale_dtype=jnp.dtype(scale_dtype or w.dtype).name,
    )
    if concrete and bool(singular):
        raise_singular(name, damp)
    return qw, rel_err


def raise_singular(name: str, damp: float) -> None:
    """The error for a Hessian that stays singular after dampening."""
    raise ValueError(
        f"{name}: the Hessian is singular after dampening (damp={damp} × mean diagonal); "
        f"increase damp or use more (and more varied) calibration data"
    )
