"""Acceptance: how many of the γ drafted tokens a sequence commits in one speculative cycle.

Every function here is one cycle's decision for a batch of B sequences, given the target's
distributions at the γ+1 verified positions (the γ drafted positions and the bonus position
after them) and the γ drafted tokens. Each returns `(tokens [B, γ+1] int32, num_emitted [B]
int32)`: the first `num_emitted[b]` entries of `tokens[b]` are committed, the rest hold
`PAD_TOKEN`. `num_emitted = num_accepted + 1` always: a cycle accepts 0..γ drafted tokens and
then commits exactly one more token from the target (a correction at the first rejected position,
or the bonus token at position γ when all γ were accepted), so every cycle makes progress.

Two acceptance modes, and greedy:

* **rejection** (`rejection_sample`, Leviathan et al. 2023; Chen et al. 2023). Draft token x_i
  is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the committed
  token is drawn from norm(max(0, p_i − q_i)); if all γ are accepted a bonus token is drawn from
  p_γ. Each committed token is distributed exactly as the target's p given the committed prefix,
  and the acceptance rate at a position, α_i = Σ_x min(p_i(x), q_i(x)) = 1 − TV(p_i, q_i), is the
  largest any exact scheme can reach. The output is exact in distribution but not sample-identical
  to plain sampling with the same seed: it consumes different random numbers.
* **coupled** (`coupled_accept`). Drafter and target share per-position Gumbel noise g_j
  (from `fold_in(key(seed), position)`); the target's token at position j is its own Gumbel-max
  sample argmax(log p_j + g_j), and the drafter proposes argmax(log q_j + g_j). The cycle commits
  the target's tokens up to and including the first position where the draft differs. The output
  is token-identical to plain (non-speculative) Gumbel-max sampling with the same seed, which makes
  speculative runs reproducible against plain ones, at the cost of a lower acceptance rate:
  P(draft = target) under any coupling is at most 1 − TV(p, q), the rejection rate.
* **greedy** (`greedy_accept`): temperature 0, where both modes reduce to comparing the draft
  with the target's argmax (ties go to the lowest token id, as `jnp.argmax`).

Shapes use the project glossary (B sequences, V vocabulary) and γ, the number of drafted tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.ops.argmax import argmax

# Value of `tokens[b, j]` for j >= num_emitted[b]. Not a valid token id, so a caller that forgets
# to mask fails loudly in an embedding lookup rather than silently committing token 0.
PAD_TOKEN = -1


# ---------------------------------------------------------------------------------------------
# Validation (host side, on static shapes; runs once per trace).
# ---------------------------------------------------------------------------------------------


def _check_rank(name: str, x: jax.Array, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape {layout}, got shape {tuple(x.shape)}")


def _check_draft_inputs(
    target: jax.Array, draft_tokens: jax.Array, target_name: str
) -> tuple[int, int, int]:
    """Checks `target [B, γ+1, V]` against `draft_tokens [B, γ]`; returns (B, γ, V)."""
    _check_rank(target_name, target, 3, "[B, γ+1, V]")
    _check_rank("draft_tokens", draft_tokens, 2, "[B, γ]")
    b, g1, v = target.shape
    if draft_tokens.shape != (b, g1 - 1):
        raise ValueError(
            f"draft_tokens must have shape [B, γ] = {(b, g1 - 1)} to match {target_name} "
            f"{tuple(target.shape)} ([B, γ+1, V]), got {tuple(draft_tokens.shape)}"
        )
    if g1 < 2:
        raise ValueError(f"{target_name} must hold γ+1 >= 2 positions (γ >= 1), got {g1}")
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(f"draft_tokens must be an integer array, got dtype {draft_tokens.dtype}")
    return b, g1 - 1, v


def _check_draft_probs(draft_probs: jax.Array, b: int, gamma: int, v: int) -> None:
    if draft_probs.shape != (b, gamma, v):
        raise ValueError(
            f"draft_probs must have shape [B, γ, V] = {(b, gamma, v)}, "
            f"got {tuple(draft_probs.shape)}"
        )


def _check_target_covers(target_probs: jax.Array, b: int, gamma: int, v: int) -> None:
    """`target_probs` may carry the bonus position or not: `[B, γ+1, V]` or `[B, γ, V]`."""
    if target_probs.ndim != 3 or target_probs.shape not in ((b, gamma + 1, v), (b, gamma, v)):
        raise ValueError(
            f"target_probs must have shape [B, γ+1, V] = {(b, gamma + 1, v)} or [B, γ, V], "
            f"with (B, γ, V) taken from draft_probs, got {tuple(target_probs.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# Shared pieces.
# ---------------------------------------------------------------------------------------------


def _commit(committed: jax.Array, num_emitted: jax.Array) -> jax.Array:
    """Masks `committed [B, γ+1]` to its first `num_emitted [B]` entries, PAD after."""
    slot = jnp.arange(committed.shape[1])[None, :]  # [1, γ+1]
    return jnp.where(slot < num_emitted[:, None], committed, PAD_TOKEN).astype(jnp.int32)


def _leading_true(flags: jax.Array) -> jax.Array:
    """Number of leading True entries of `flags [B, γ]` per row: `[B]` int32."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _match_target(target_choice: jax.Array, draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Commits the target's own tokens `[B, γ+1]` up to and including the first mismatch."""
    gamma = draft_tokens.shape[1]
    matches = draft_tokens == target_choice[:, :gamma]  # [B, γ]
    num_emitted = _leading_true(matches) + 1  # [B]
    return _commit(target_choice, num_emitted), num_emitted


# ---------------------------------------------------------------------------------------------
# Rejection sampling.
# ---------------------------------------------------------------------------------------------


def acceptance_probs(
    target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array
) -> jax.Array:
    """The probability min(1, p_i(x_i) / q_i(x_i)) of accepting each drafted token.

    Guarded so it never produces NaN: a drafted token with q(x) = 0 (which a correct drafter
    never proposes) is accepted when p(x) > 0 (the ratio is +inf) and rejected when p(x) = 0.

    Args:
      target_probs: `[B, γ+1, V]` (or `[B, γ, V]`) target probabilities p.
      draft_probs: `[B, γ, V]` draft probabilities q.
      draft_tokens: `[B, γ]` the drafted tokens x.

    Returns:
      `[B, γ]` float32 acceptance probabilities, in [0, 1].
    """
    _check_rank("draft_probs", draft_probs, 3, "[B, γ, V]")
    b, gamma, v = draft_probs.shape
    _check_target_covers(target_probs, b, gamma, v)
    if draft_tokens.shape != (b, gamma):
        raise ValueError(
            f"draft_tokens must have shape [B, γ] = {(b, gamma)}, got {tuple(draft_tokens.shape)}"
        )
    return _acceptance_probs(target_probs, draft_probs, draft_tokens)


@jax.jit
def _acceptance_probs(target_probs, draft_probs, draft_tokens):
    gamma = draft_tokens.shape[1]
    idx = draft_tokens[..., None].astype(jnp.int32)  # [B, γ, 1]
    p = jnp.take_along_axis(target_probs[:, :gamma].astype(jnp.float32), idx, axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs.astype(jnp.float32), idx, axis=-1)[..., 0]  # [B, γ]
    ratio = p / jnp.where(q > 0, q, 1.0)  # [B, γ]; safe denominator
    return jnp.where(q > 0, jnp.minimum(ratio, 1.0), jnp.where(p > 0, 1.0, 0.0))


def expected_acceptance(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """The acceptance rate α_i = Σ_x min(p_i(x), q_i(x)) = 1 − TV(p_i, q_i) at each position.

    This is the expected value of `acceptance_probs` when x_i ~ q_i: the per-position α of the
    speedup model (`jaxinfer.speculative.speedup`).

    Args:
      target_probs: `[B, γ+1, V]` (or `[B, γ, V]`) target probabilities p.
      draft_probs: `[B, γ, V]` draft probabilities q.

    Returns:
      `[B, γ]` float32.
    """
    _check_rank("draft_probs", draft_probs, 3, "[B, γ, V]")
    b, gamma, v = draft_probs.shape
    _check_target_covers(target_probs, b, gamma, v)
    return _expected_acceptance(target_probs, draft_probs)


@jax.jit
def _expected_acceptance(target_probs, draft_probs):
    gamma = draft_probs.shape[1]
    p = target_probs[:, :gamma].astype(jnp.float32)  # [B, γ, V]
    return jnp.sum(jnp.minimum(p, draft_probs.astype(jnp.float32)), axis=-1)


def correction_probs(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """The distribution the committed token is drawn from when the cycle stops at position i.

    For i < γ (a rejection) it is norm(max(0, p_i − q_i)); for i = γ (all accepted, bonus) it is
    p_γ: padding q with a zero row at γ makes both the same formula. When the residual has no
    mass (p_i = q_i, so the position can never be rejected; or p_i <= q_i everywhere through
    rounding) the row falls back to p_i rather than dividing by zero.

    Args:
      target_probs: `[B, γ+1, V]` target probabilities p.
      draft_probs: `[B, γ, V]` draft probabilities q.

    Returns:
      `[B, γ+1, V]` float32, each row summing to 1 (for valid p).
    """
    _check_rank("target_probs", target_probs, 3, "[B, γ+1, V]")
    b, g1, v = target_probs.shape
    _check_draft_probs(draft_probs, b, g1 - 1, v)
    return _correction_probs(target_probs, draft_probs)


@jax.jit
def _correction_probs(target_probs, draft_probs):
    p = target_probs.astype(jnp.float32)  # [B, γ+1, V]
    q = jnp.pad(draft_probs.astype(jnp.float32), ((0, 0), (0, 1), (0, 0)))  # [B, γ+1, V]
    residual = jnp.maximum(p - q, 0.0)  # [B, γ+1, V]
    mass = jnp.sum(residual, axis=-1, keepdims=True)  # [B, γ+1, 1]
    return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)


@jax.jit
def _rejection_sample_with_noise(target_probs, draft_probs, draft_tokens, uniforms, gumbel):
    accept = uniforms < _acceptance_probs(target_probs, draft_probs, draft_tokens)  # [B, γ]
    num_accepted = _leading_true(accept)  # [B]
    # Only the row where the cycle stops is ever sampled from, so gather it before sampling.
    stop_probs = jnp.take_along_axis(
        _correction_probs(target_probs, draft_probs), num_accepted[:, None, None], axis=1
    )[:, 0]  # [B, V]
    # Gumbel-max: log 0 = -inf keeps zero-mass tokens out without producing NaN.
    last = argmax(jnp.log(stop_probs) + gumbel.astype(jnp.float32))  # [B]
    gamma = draft_tokens.shape[1]
    committed = jnp.concatenate(
        [draft_tokens.astype(jnp.int32), jnp.zeros_like(last, jnp.int32)[:, None]], axis=1
    )  # [B, γ+1]
    slot = jnp.arange(gamma + 1)[None, :]  # [1, γ+1]
    committed = jnp.where(slot == num_accepted[:, None], last[:, None], committed)
    num_emitted = num_accepted + 1
    return _commit(committed, num_emitted), num_emitted


def rejection_sample_with_noise(
    target_probs: jax.Array,
    draft_probs: jax.Array,
    draft_tokens: jax.Array,
    uniforms: jax.Array,
    gumbel: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`rejection_sample` with its randomness passed in, so a caller can derive it per request.

    Draft token i is accepted iff `uniforms[b, i] < acceptance_probs(...)[b, i]`; the token at
    the stopping position n = num_accepted is argmax(log correction_probs[b, n] + gumbel[b]).

    Args:
      target_probs: `[B, γ+1, V]` processed target probabilities p.
      draft_probs: `[B, γ, V]` processed draft probabilities q.
      draft_tokens: `[B, γ]` integer, the drafted tokens (x_i ~ q_i).
      uniforms: `[B, γ]` float, Uniform[0, 1) noise, one per drafted position.
      gumbel: `[B, V]` float, standard Gumbel noise for the one token drawn by the target.

    Returns:
      tokens: `[B, γ+1]` int32, committed tokens then `PAD_TOKEN`.
      num_emitted: `[B]` int32 in [1, γ+1]; the number of accepted drafts is num_emitted − 1.
    """
    b, gamma, v = _check_draft_inputs(target_probs, draft_tokens, "target_probs")
    _check_draft_probs(draft_probs, b, gamma, v)
    if uniforms.shape != (b, gamma):
        raise ValueError(f"uniforms must have shape [B, γ] = {(b, gamma)}, got {uniforms.shape}")
    if gumbel.shape != (b, v):
        raise ValueError(f"gumbel must have shape [B, V] = {(b, v)}, got {gumbel.shape}")
    return _rejection_sample_with_noise(target_probs, draft_probs, draft_tokens, uniforms, gumbel)


def _row_keys(key: jax.Array, b: int) -> jax.Array:
    """One typed key per sequence `[B]`, from a single key or from per-sequence keys."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ValueError(
                "key must be a typed PRNG key (jax.random.key) or raw uint32 key data [..., 2], "
                f"got dtype {key.dtype} and shape {tuple(key.shape)}"
            )
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, b)
    if key.shape == (b,):
        return key
    raise ValueError(
        f"key must be a single key or one key per sequence [B] = ({b},), got shape {key.shape}"
    )


@functools.partial(jax.jit, static_argnames=("gamma", "v"))
def _noise(keys: jax.Array, gamma: int, v: int) -> tuple[jax.Array, jax.Array]:
    def one(k):
        k_accept, k_correct = jax.random.split(k)
        return jax.random.uniform(k_accept, (gamma,)), jax.random.gumbel(k_correct, (v,))

    return jax.vmap(one)(keys)  # [B, γ], [B, V]


def rejection_sample(
    key: jax.Array,
    target_probs: jax.Array,
    draft_probs: jax.Array,
    draft_tokens: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Exact speculative rejection sampling of one cycle for a batch of sequences.

    Accepts drafted token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    commits a sample of norm(max(0, p_i − q_i)); if all γ are accepted commits a bonus sample of
    p_γ. Committed tokens are distributed exactly as the target's p (see the module docstring).
    p and q must be the *processed* distributions (after temperature, top-k, top-p, min-p).

    Args:
      key: a PRNG key, either one for the whole batch or one per sequence `[B]` (pass
        `fold_in(key(seed), position)` per sequence to make a request's output independent of the
        rest of the batch). Typed keys and raw uint32 key data are both accepted.
      target_probs: `[B, γ+1, V]` target probabilities at the γ drafted positions and the bonus.
      draft_probs: `[B, γ, V]` draft probabilities the drafted tokens were sampled from.
      draft_tokens: `[B, γ]` integer, the drafted tokens.

    Returns:
      tokens: `[B, γ+1]` int32, the committed tokens followed by `PAD_TOKEN`.
      num_emitted: `[B]` int32 in [1, γ+1]; the number of accepted drafts is num_emitted − 1.
    """
    b, gamma, v = _check_draft_inputs(target_probs, draft_tokens, "target_probs")
    _check_draft_probs(draft_probs, b, gamma, v)
    uniforms, gumbel = _noise(_row_keys(key, b), gamma, v)
    return _rejection_sample_with_noise(target_probs, draft_probs, draft_tokens, uniforms, gumbel)


# ---------------------------------------------------------------------------------------------
# Coupled and greedy acceptance.
# ---------------------------------------------------------------------------------------------


@jax.jit
def _coupled_accept(target_logprobs, draft_tokens, gumbel):
    target_choice = argmax(
        target_logprobs.astype(jnp.float32) + gumbel.astype(jnp.float32)
    )  # [B, γ+1]
    return _match_target(target_choice, draft_tokens)


def coupled_accept(
    target_logprobs: jax.Array, draft_tokens: jax.Array, gumbel: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Coupled acceptance: commit the target's Gumbel-max tokens up to the first disagreement.

    The target's token at position j is argmax(log p_j + g_j). Drafted tokens are accepted while
    they equal it; the first differing position still commits the target's token, and if all γ
    match the bonus is the target's token at position γ. With g_j drawn from
    `fold_in(key(seed), position_j)` (`jaxinfer.sampling.gumbel_noise`) and the drafter using the
    same g_j, the committed stream equals plain Gumbel-max sampling with that seed, token for token.

    Args:
      target_logprobs: `[B, γ+1, V]` processed target log-probabilities (unnormalised logits after
        temperature and filtering give the same tokens; -inf marks filtered tokens).
      draft_tokens: `[B, γ]` integer, the drafted tokens.
      gumbel: `[B, γ+1, V]` the shared Gumbel noise at the γ+1 verified positions.

    Returns:
      tokens: `[B, γ+1]` int32, the committed tokens followed by `PAD_TOKEN`.
      num_emitted: `[B]` int32 in [1, γ+1].
    """
    _check_draft_inputs(target_logprobs, draft_tokens, "target_logprobs")
    if gumbel.shape != target_logprobs.shape:
        raise ValueError(
            f"gumbel must have the shape of target_logprobs {tuple(target_logprobs.shape)} "
            f"([B, γ+1, V]), got {tuple(gumbel.shape)}"
        )
    return _coupled_accept(target_logprobs, draft_tokens, gumbel)


@jax.jit
def _greedy_accept(target_logits, draft_tokens):
    target_choice = argmax(target_logits)  # [B, γ+1]
    return _match_target(target_choice, draft_tokens)


def greedy_accept(target_logits: jax.Array, draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Temperature-0 acceptance: commit the target's argmax tokens up to the first disagreement.

    The committed stream equals the target's greedy decoding, token for token.

    Args:
      target_logits: `[B, γ+1, V]` target logits (or any monotone transform of them).
      draft_tokens: `[B, γ]` integer, the drafted tokens.

    Returns:
      tokens: `[B, γ+1]` int32, the committed tokens followed by `PAD_TOKEN`.
      num_emitted: `[B]` int32 in [1, γ+1].
    """
    _check_draft_inputs(target_logits, draft_tokens, "target_logits")
    return _greedy_accept(target_logits, draft_tokens)
