"""Sampling: validated SamplingParams, logits processing in float32, Gumbel-max sampling.

The *declared distribution* of a request is softmax of its logits after temperature, top-k,
top-p and min-p, in that order. Sampling is Gumbel-max, `argmax(logits / T + g)` with
`g ~ Gumbel(0, 1)` drawn from `fold_in(key(seed), position)`: a request's randomness depends only
on its own seed and the position being sampled, never on its batch neighbours, and speculative
decoding can reproduce plain sampling exactly by sharing the same noise. The parallel samples
1..n-1 of an n > 1 request (the engine's forks) fold their `sample_index` in before the position.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checks import INT32_MAX, as_float, as_int, is_int
from jaxinfer.ops.argmax import argmax

_NEG_INF = -jnp.inf
# temperature and top_p reach the device as float32: a positive value below this divides the
# logits to inf (temperature 1e-40 sampled token 0, not the argmax) or rounds to 0 (top_p 1e-46
# kept every token). At 1e-30, logits up to 3e8 stay finite.
MIN_POSITIVE = 1e-30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated at construction.

    Attributes:
      temperature: 0 is greedy; otherwise (>= 1e-30, float32 on the device) logits are
        divided by it.
      top_k: keep the k most likely tokens; 0 turns it off.
      top_p: keep the smallest set whose probability reaches top_p (nucleus), in [1e-30, 1];
        1 turns it off.
      min_p: drop tokens less likely than min_p times the most likely one; 0 turns it off.
      max_tokens: the most tokens to generate.
      stop_token_ids: generation stops after emitting any of these (the stop token is kept).
      seed: the request's randomness; same seed and prompt -> same output, in any batch.
      ignore_eos: do not stop on the model's eos token.
      n: parallel samples per prompt (the engine forks the prompt's blocks).
      logprobs: None, or return the sampled token's log-probability and this many top
        alternatives per token (the engine; the model's distribution before processing).
      presence_penalty: subtracted from the logit of every token the output holds, in [-2, 2]
        (OpenAI's range); 0 turns it off.
      frequency_penalty: subtracted once per occurrence in the output, in [-2, 2]; 0: off.
      repetition_penalty: tokens of the prompt or the output have positive logits divided by
        it and negative ones multiplied (the CTRL paper's rule, as transformers and vLLM), in
        [0.01, 100] (float32 logits stay finite); 1 turns it off.
      logit_bias: `{token id: bias}` (or `(id, bias)` pairs) added to the logits, each bias in
        [-100, 100] (OpenAI's range); stored as pairs sorted by id.
      min_tokens: the stop tokens (`stop_token_ids` and the model's eos unless `ignore_eos`)
        cannot be sampled before this many tokens were generated (vLLM's `min_tokens`); at most
        max_tokens; 0 turns it off.
      allowed_token_ids: None, or the only token ids that may be sampled (vLLM's
        `allowed_token_ids`); a non-empty set, stored sorted.
      bad_words_ids: banned token sequences (transformers' `bad_words_ids`, vLLM's `bad_words`
        once tokenized), a tuple of non-empty tuples of token ids kept in order (None: none):
        a sequence w of one token is never sampled; a longer one's last token is not sampled
        where the output ends with w[:-1] (the output only, not the prompt, as vLLM). At most
        MAX_BAD_WORDS sequences of at most MAX_BAD_WORD_LEN tokens (the step's tables grow
        with both).

    The penalties, the bias and the three masks act on the logits before temperature
    (`jaxinfer.penalties`), in vLLM's order: bias, repetition, frequency and presence, then the
    masks. They change greedy rows too.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        def bad(field, expected):
            raise ValueError(
                f"SamplingParams.{field}={getattr(self, field)!r} is invalid: expected {expected}"
            )

        def real(field, ok, expected):
            v = as_float(getattr(self, field))
            if v is None or not math.isfinite(v) or not ok(v):
                bad(field, expected)
            object.__setattr__(self, field, v)

        def integer(field, lo, hi, expected):
            v = as_int(getattr(self, field))
            if v is None or not lo <= v <= hi:
                bad(field, expected)
            object.__setattr__(self, field, v)

        # Numbers are normalized to Python ones (jaxinfer.checks); every int below reaches the
        # device as int32, so each is bounded by INT32_MAX.
        real("temperature", lambda t: t == 0 or t >= MIN_POSITIVE, "0 or a finite number >= 1e-30")
        real("top_p", lambda p: MIN_POSITIVE <= p <= 1, "a number in [1e-30, 1]")
        real("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        integer("top_k", 0, INT32_MAX, "an int in [0, 2**31 - 1] (0 = off)")
        integer("max_tokens", 1, INT32_MAX, "an int in [1, 2**31 - 1]")
        integer("seed", 0, INT32_MAX, "an int in [0, 2**31)")
        integer("n", 1, INT32_MAX, "an int in [1, 2**31 - 1]")
        if self.logprobs is not None:
            integer("logprobs", 0, 20, "None or an int in [0, 20]")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            bad("ignore_eos", "a bool")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        real("presence_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        real("frequency_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        real("repetition_penalty", lambda v: 0.01 <= v <= 100, "a number in [0.01, 100]")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        integer("min_tokens", 0, self.max_tokens, f"an int in [0, max_tokens = {self.max_tokens}]")
        object.__setattr__(self, "stop_token_ids", _token_ids(self, "stop_token_ids"))
        if self.allowed_token_ids is not None:
            allowed = sorted(set(_token_ids(self, "allowed_token_ids")))
            if not allowed:
                bad("allowed_token_ids", "None or a non-empty sequence of token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        object.__setattr__(self, "bad_words_ids", _bad_words(self.bad_words_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> dict:
        """The penalty and logit-bias settings that are on, `{field: value}`."""
        return {
            k: getattr(self, k) for k in PENALTY_FIELDS if getattr(self, k) != _NEUTRAL_PENALTY[k]
        }

    @functools.cached_property  # read for every step of the engine: converted once
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as `([K] int32 ids, [K] float32 biases)`."""
        ids = np.array([t for t, _ in self.logit_bias], np.int32)
        return ids, np.array([b for _, b in self.logit_bias], np.float32)

    @functools.cached_property  # read for every engine step: converted once
    def allowed_token_ids_array(self) -> np.ndarray:
        """`allowed_token_ids` as `[A]` int32 (empty for None)."""
        return np.array(self.allowed_token_ids or (), np.int32)

    @functools.cached_property  # read for every engine step: converted once
    def bad_words_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`bad_words_ids` as `([N, P] int32 prefixes, [N] int32 last tokens)`: each prefix
        w[:-1] right-aligned in P = the longest prefix (at least 1) slots, the slots before it
        holding -1 (any token)."""
        words = self.bad_words_ids
        prefix = np.full((len(words), max([len(w) - 1 for w in words] + [1])), -1, np.int32)
        for i, w in enumerate(words):
            prefix[i, prefix.shape[1] - len(w) + 1 :] = w[:-1]
        return prefix, np.array([w[-1] for w in words], np.int32)

    @functools.cached_property  # read for every row of every engine step
    def penalized(self) -> bool:
        """Whether a penalty, a logit bias or a mask is on (the step then needs the history)."""
        return bool(self.penalties)


PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                  "min_tokens", "allowed_token_ids", "bad_words_ids")  # fmt: skip
_NEUTRAL_PENALTY = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                    "logit_bias": (), "min_tokens": 0, "allowed_token_ids": None,
                    "bad_words_ids": ()}  # fmt: skip
# bad_words_ids: each step's tables are [B, bucket(count), bucket(longest - 1)] per row, and
# vLLM's tokenized words are a few tokens each.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_LEN = 32


def _token_ids(sp: SamplingParams, field: str) -> tuple[int, ...]:
    """`sp.<field>` as a tuple of Python ints in [0, 2**31 - 1]; raises ValueError naming it."""
    ids = getattr(sp, field)
    msg = f"SamplingParams.{field}={ids!r} is invalid: expected a sequence of ints in [0, 2**31)"
    if isinstance(ids, str | bytes) or is_int(ids) or getattr(ids, "ndim", 1) != 1:
        raise ValueError(msg)
    try:
        out = [as_int(t) for t in ids]
    except TypeError:
        raise ValueError(msg) from None
    if not all(t is not None and 0 <= t <= INT32_MAX for t in out):
        raise ValueError(msg)
    return tuple(out)


def _bad_words(words) -> tuple[tuple[int, ...], ...]:
    """`bad_words_ids` as a tuple of tuples of Python ints; raises ValueError naming the bad
    entry."""
    expected = (
        f"a sequence of at most {MAX_BAD_WORDS} non-empty sequences of at most "
        f"{MAX_BAD_WORD_LEN} token ids in [0, 2**31)"
    )

    def bad(what):
        raise ValueError(
            f"SamplingParams.bad_words_ids={words!r} is invalid: {what}expected {expected}"
        )

    def seq(x) -> bool:  # a flat sequence, not a string or a number
        kind = isinstance(x, Sequence | np.ndarray | jax.Array) and not isinstance(x, str | bytes)
        return kind and getattr(x, "ndim", 1) == 1

    if words is None:  # as transformers' default: no bans
        return ()
    if getattr(words, "ndim", None) == 2:  # a [N, L] array: N sequences of L ids
        words = list(words)
    if not seq(words):
        bad("")
    if len(words) > MAX_BAD_WORDS:
        bad(f"{len(words)} sequences; ")
    out = []
    for w in words:
        if not seq(w) or len(w) == 0:
            bad(f"entry {w!r} is not a non-empty sequence of token ids; ")
        if len(w) > MAX_BAD_WORD_LEN:
            bad(f"entry {w!r} has {len(w)} tokens; ")
        ids = [as_int(t) for t in w]
        for t, i in zip(w, ids):
            if i is None or not 0 <= i <= INT32_MAX:
                bad(f"token id {t!r} of entry {w!r}; ")
        out.append(tuple(ids))
    return tuple(out)


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as `((id, bias), ...)` sorted by id; raises ValueError naming the entry."""
    expected = "a {token id: bias} mapping or (id, bias) pairs, ids in [0, 2**31 - 1]"
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, str | bytes) or not isinstance(bias, Sequence | np.ndarray):
        raise ValueError(f"SamplingParams.logit_bias={bias!r} is invalid: expected {expected}")
    else:
        items = list(bias)
    pairs = {}
    for item in items:
        if not isinstance(item, Sequence | np.ndarray) or len(item) != 2:
            raise ValueError(
                f"SamplingParams.logit_bias={bias!r} is invalid: entry {item!r} is not an "
                f"(id, bias) pair; expected {expected}"
            )
        tid, b = as_int(item[0]), as_float(item[1])
        if tid is None or not 0 <= tid <= INT32_MAX:
            raise ValueError(
                f"SamplingParams.logit_bias={bias!r} is invalid: token id {item[0]!r}; expected "
                f"{expected}"
            )
        if b is None or not -100 <= b <= 100:
            raise ValueError(
                f"SamplingParams.logit_bias={bias!r} is invalid: bias {item[1]!r} of token {tid};"
                " expected a number in [-100, 100]"
            )
        if tid in pairs:
            raise ValueError(
                f"SamplingParams.logit_bias={bias!r} is invalid: token id {tid} appears twice"
            )
        pairs[tid] = b
    return tuple(sorted(pairs.items()))


_PAD_ROW = SamplingParams(temperature=0.0)  # padding rows of a SamplingBatch: greedy, seed 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as device arrays, so one compiled step serves any mix."""

    temperature: jax.Array  # [B] float32 (0 = greedy)
    top_k: jax.Array  # [B] int32 (0 = off)
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    seed: jax.Array  # [B] int32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], pad_to: int | None = None):
        """Stacks per-request params; padding rows are greedy with seed 0."""
        rows = list(params) + [_PAD_ROW] * ((pad_to or 0) - len(params))
        return cls(
            temperature=np.array([p.temperature for p in rows], np.float32),
            top_k=np.array([p.top_k for p in rows], np.int32),
            top_p=np.array([p.top_p for p in rows], np.float32),
            min_p=np.array([p.min_p for p in rows], np.float32),
            seed=np.array([p.seed for p in rows], np.int32),
        )

    def take(self, idx: jax.Array) -> SamplingBatch:
        """Rows `idx` (e.g. one row per verified position of a sequence)."""
        return jax.tree.map(lambda x: x[idx], self)


def _top_k_top_p(x: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Masks `x [B, V]` (temperature applied) to each row's top-k, then its top-p nucleus."""
    v = x.shape[-1]
    sorted_desc = -jnp.sort(-x, axis=-1)  # [B, V]
    # top-k: threshold at the k-th largest value (ties at the threshold are kept).
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    x = jnp.where(x < kth, _NEG_INF, x)
    # top-p over what top-k kept: keep a sorted token if the mass before it is < top_p.
    sorted_desc = jnp.where(sorted_desc < kth, _NEG_INF, sorted_desc)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    # top_p = 1 keeps everything even where float cumsums overshoot 1.
    keep_sorted = (mass_before < sb.top_p[:, None]) | (sb.top_p[:, None] >= 1)
    last_kept = jnp.sum(keep_sorted, axis=-1) - 1  # [B] >= 0: the top token is always kept
    p_thresh = jnp.take_along_axis(sorted_desc, last_kept[:, None], axis=-1)
    x = jnp.where(x < p_thresh, _NEG_INF, x)
    return x


def process_logits(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Temperature, top-k, top-p and min-p on `logits [B, V]`; masked entries are -inf.

    Returns float32 logits whose softmax is each row's declared distribution. Greedy rows
    (temperature 0) are returned unscaled and unmasked: their distribution is the argmax.
    """
    logits = logits.astype(jnp.float32)
    greedy = sb.temperature <= 0
    x = logits / jnp.where(greedy, 1.0, sb.temperature)[:, None]

    # Sorting V logits dominates a small model's decode step: skip it when no row needs it.
    needs_sort = jnp.any((sb.top_k > 0) | (sb.top_p < 1))
    x = jax.lax.cond(needs_sort, _top_k_top_p, lambda x, sb: x, x, sb)
    # min-p relative to the most likely token.
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < sb.min_p[:, None] * jnp.max(probs, -1, keepdims=True), _NEG_INF, x)
    return jnp.where(greedy[:, None], logits, x)


def _noise_key(seed: jax.Array, position: jax.Array, sample_index: jax.Array | None) -> jax.Array:
    """`fold_in(key(seed), position)`; a `sample_index` > 0 is folded in before the position."""
    key = jax.random.key(seed)
    if sample_index is not None:
        key = jax.lax.cond(
            sample_index > 0, lambda k: jax.random.fold_in(k, sample_index), lambda k: k, key
        )
    return jax.random.fold_in(key, position)


def gumbel_noise(
    seeds: jax.Array,
    positions: jax.Array,
    vocab_size: int,
    sample_index: jax.Array | None = None,
) -> jax.Array:
    """Gumbel(0, 1) noise `[B, V]` from `fold_in(key(seed), position)` per row.

    Args:
      seeds: `[B]` int32 per-row seeds.
      positions: `[B]` int32 the position each sampled token will occupy.
      vocab_size: V.
      sample_index: `[B]` int32 which of its request's n samples each row is; None or 0 gives the
        key above, an index i > 0 gives `fold_in(fold_in(key(seed), i), position)`, so the
        parallel samples of one request draw different noise.
    """
    _check_sample_index(sample_index, positions)

    def one(seed, pos, index):
        return jax.random.gumbel(_noise_key(seed, pos, index), (vocab_size,))

    if sample_index is None:
        return jax.vmap(lambda seed, pos: one(seed, pos, None))(seeds, positions)
    return jax.vmap(one)(seeds, positions, sample_index)


def _check_sample_index(sample_index: jax.Array | None, positions: jax.Array) -> None:
    if sample_index is not None and jnp.shape(sample_index) != jnp.shape(positions):
        raise ValueError(
            f"sample_index has shape {jnp.shape(sample_index)}, expected one index per row: "
            f"{jnp.shape(positions)} like positions"
        )


def sample(
    logits: jax.Array,
    sb: SamplingBatch,
    positions: jax.Array,
    sample_index: jax.Array | None = None,
) -> jax.Array:
    """Samples one token per row of `logits [B, V]` at sequence `positions [B]` -> `[B]` int32.

    `positions` is the position the sampled token will occupy in its sequence. `sample_index`
    (`[B]` int32, optional) selects the noise of the request's i-th parallel sample (see
    `gumbel_noise`); None or 0 is the noise of `ji.generate`.
    """
    _check_sample_index(sample_index, positions)

    def greedy_only():
        return argmax(logits)

    def mixed():
        x = process_logits(logits, sb)
        g = gumbel_noise(sb.seed, positions, logits.shape[-1], sample_index)
        sampled = argmax(x + g)
        return jnp.where(sb.temperature <= 0, argmax(x), sampled)

    # An all-greedy batch (the common benchmark case) needs neither noise nor processing.
    return jax.lax.cond(jnp.all(sb.temperature <= 0), greedy_only, mixed)


def probs(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """The declared distribution `[B, V]` float32 (one-hot argmax for greedy rows)."""
    x = process_logits(logits, sb)
    onehot = jax.nn.one_hot(argmax(x), x.shape[-1], dtype=jnp.float32)
    return jnp.where(sb.temperature[:, None] <= 0, onehot, jax.nn.softmax(x, axis=-1))
