"""Quality measurements: perplexity, top-1 accuracy, a unigram baseline, agreement and KL to a
reference (a draft to its target, a quantized model to its float original).

Every measure runs over fixed next-token windows `[N, S+1]` (inputs `w[:, :-1]`, targets
`w[:, 1:]`), so different models are scored on exactly the same predictions. The standard budget
(`standard_windows`) is the first `EVAL_TOKENS` = 65,536 tokens of the shipped test split's stream
(documents wrapped in bos/eos) in windows of `EVAL_SEQ_LEN` = 256 tokens: 255 windows, 65,280
predicted tokens, each predicted exactly once (`jaxinfer.data.eval_windows`).

Every measure runs the one scoring loop `_score` over a list of models: a jitted logits function
per model (`jaxinfer.window_logits`: the dense forward, or the paged forward over a fresh cache
of a KV format), then jitted per-window sums of cross entropy and correct top-1 and, against the
first model, of KL and argmax agreement. Batches are padded to a fixed size so each runs one
compilation; padded windows are dropped on the host.

Serving numerics (`lm_stats_paged`, and `compare_to_reference` with a KV format): each window is
prefilled as one ragged chunk with logits "all" through the paged `forward`, which writes its K/V
into a fresh cache of the given format ("float", "int8", "fp8") and attends to them as stored
(dequantized), so a quantized KV cache is measured exactly as the engine would run it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import data
from jaxinfer.cache.paged import KV_FORMATS, check_block_size
from jaxinfer.checks import as_int
from jaxinfer.config import ModelConfig
from jaxinfer.losses import token_cross_entropy
from jaxinfer.model.params import check_params
from jaxinfer.ops.argmax import argmax
from jaxinfer.window_logits import PAGED_BATCH_SIZE, check_kv_format, logits_fn

EVAL_TOKENS = 65_536  # the standard token budget: the first 64 Ki tokens of the test stream
EVAL_SEQ_LEN = 256  # the window the embedded models were trained on
EVAL_BATCH_SIZE = 16  # windows per jitted forward


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------


def standard_windows(
    tokenizer=None, seq_len: int = EVAL_SEQ_LEN, max_tokens: int = EVAL_TOKENS
) -> np.ndarray:
    """The standard evaluation windows over the shipped test split.

    Args:
      tokenizer: a `tokenizers.Tokenizer`; None for the shipped one.
      seq_len: tokens per input window.
      max_tokens: token budget read from the start of the test stream.

    Returns:
      [num_windows, seq_len + 1] int32.
    """
    tok = data.load_tokenizer() if tokenizer is None else tokenizer
    stream = data.tokenize_documents(tok, data.load_split("test"))  # [N]
    return data.eval_windows(stream, seq_len, max_tokens)


def _as_windows(cfg: ModelConfig, tokens, seq_len: int, max_tokens: int | None) -> np.ndarray:
    """Validates `[N, S+1]` windows, or cuts a 1-D stream into them (`data.eval_windows`)."""
    arr = np.asarray(tokens)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    if arr.ndim == 1:
        budget = arr.shape[0] if max_tokens is None else max_tokens
        arr = data.eval_windows(arr, seq_len, budget)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise ValueError(
            f"tokens must be a stream [N] or windows [N, S+1] with N >= 1 and S >= 1, got shape "
            f"{np.asarray(tokens).shape}"
        )
    if arr.shape[1] - 1 > cfg.max_position_embeddings:
        raise ValueError(
            f"window inputs of {arr.shape[1] - 1} tokens exceed max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(
            f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {cfg.vocab_size})"
        )
    return arr.astype(np.int32)


def _batches(windows: np.ndarray, batch_size: int, desc: str, progress: bool) -> Iterator:
    """Yields (real count, [batch_size, S+1] batch), the last one padded with its last window."""
    from tqdm.auto import tqdm

    if as_int(batch_size) is None or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = windows.shape[0]
    starts = range(0, n, batch_size)
    for start in tqdm(starts, desc=desc, disable=not progress, unit="batch"):
        chunk = windows[start : start + batch_size]  # [<=B, S+1]
        real = chunk.shape[0]
        if real < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
        yield real, chunk


# ---------------------------------------------------------------------------------------------
# Public measures
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMStats:
    """Next-token statistics of one model over a set of windows."""

    num_tokens: int  # predicted tokens (windows x S)
    nll: float  # mean cross entropy, nats / token
    accuracy: float  # fraction of targets equal to the argmax prediction

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def lm_stats(
    cfg: ModelConfig,
    params: dict,
    tokens,
    *,
    seq_len: int = EVAL_SEQ_LEN,
    max_tokens: int | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    progress: bool = False,
) -> LMStats:
    """Cross entropy and top-1 accuracy of a model on fixed windows.

    Args:
      cfg: model config.
      params: params pytree.
      tokens: windows [N, S+1] int, or a stream [N] cut by `data.eval_windows(stream, seq_len,
        max_tokens)` (None: the whole stream).
      seq_len: window length when `tokens` is a stream.
      max_tokens: token budget when `tokens` is a stream.
      batch_size: windows per jitted forward.
      progress: show a tqdm bar.

    Returns:
      The LMStats (`.perplexity = exp(nll)`).
    """
    check_params(cfg, params)
    windows = _as_windows(cfg, tokens, seq_len, max_tokens)
    models = [logits_fn(cfg, params, None, 16, "auto", batch_size)]
    sums, n = _score(models, windows, batch_size, "eval", progress)
    ce, correct = sums[0, :2]
    return LMStats(num_tokens=n, nll=float(ce / n), accuracy=float(correct / n))


def perplexity(cfg: ModelConfig, params: dict, tokens, **kwargs) -> float:
    """exp(mean next-token cross entropy) on windows [N, S+1] or a stream; see `lm_stats`."""
    return lm_stats(cfg, params, tokens, **kwargs).perplexity


def top1_accuracy(cfg: ModelConfig, params: dict, tokens, **kwargs) -> float:
    """Fraction of next tokens equal to the model's argmax; arguments as `lm_stats`."""
    return lm_stats(cfg, params, tokens, **kwargs).accuracy


@dataclasses.dataclass(frozen=True)
class PairStats:
    """How closely model b (a draft) follows model a (the target) on the same windows."""

    num_tokens: int
    agreement: float  # fraction of positions where the two argmaxes agree (greedy agreement)
    kl: float  # mean KL(a || b) of the next-token distributions, nats / token


def pair_stats(
    target: tuple[ModelConfig, dict],
    draft: tuple[ModelConfig, dict],
    tokens,
    *,
    seq_len: int = EVAL_SEQ_LEN,
    max_tokens: int | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    progress: bool = False,
) -> PairStats:
    """Greedy agreement and KL(target || draft) on fixed windows.

    Args:
      target: (config, params) of the reference model.
      draft: (config, params) of the compared model; same vocabulary.
      tokens, seq_len, max_tokens, batch_size, progress: as in `lm_stats`.

    Returns:
      The PairStats.
    """
    (cfg_a, _), (cfg_b, _) = target, draft
    if cfg_a.vocab_size != cfg_b.vocab_size:
        raise ValueError(f"vocab sizes differ: target {cfg_a.vocab_size}, draft {cfg_b.vocab_size}")
    windows = _as_windows(cfg_a, tokens, seq_len, max_tokens)
    _as_windows(cfg_b, windows, seq_len, None)  # the draft's limits too
    models = [logits_fn(c, p, None, 16, "auto", batch_size) for c, p in (target, draft)]
    sums, n = _score(models, windows, batch_size, "agreement", progress, ce=False)
    _, _, kl, agree = sums[1]
    return PairStats(num_tokens=n, agreement=float(agree / n), kl=float(kl / n))


def greedy_agreement(
    target: tuple[ModelConfig, dict], draft: tuple[ModelConfig, dict], tokens, **kwargs
) -> float:
    """Fraction of positions where target and draft argmaxes agree; see `pair_stats`."""
    return pair_stats(target, draft, tokens, **kwargs).agreement


# ---------------------------------------------------------------------------------------------
# Serving numerics: scoring through the paged forward, comparison to a reference
# ---------------------------------------------------------------------------------------------


def _check_sizes(block_size, batch_size) -> None:
    check_block_size(block_size)
    if as_int(batch_size) is None or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


@jax.jit
def _ce_correct(logits, targets):
    """Per window: summed cross entropy [B] and correct top-1 count [B] of `logits [B, S, V]`."""
    correct = jnp.sum(argmax(logits) == targets, axis=-1)  # [B]
    return jnp.sum(token_cross_entropy(logits, targets), axis=-1), correct


@jax.jit
def _kl_agree(ref_logits, logits):
    """Per window: summed KL(ref || model) [B] and positions where the argmaxes agree [B]."""
    log_p = jax.nn.log_softmax(ref_logits, axis=-1)  # [B, S, V]
    log_q = jax.nn.log_softmax(logits, axis=-1)  # [B, S, V]
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=(-2, -1))  # [B]
    agree = jnp.sum(argmax(log_p) == argmax(log_q), axis=-1)  # [B]
    return kl, agree


def _score(models, windows: np.ndarray, batch_size: int, desc: str, progress: bool, ce=True):
    """The one scoring loop of every measure: dense or paged, float or quantized KV.

    Args:
      models: host functions `inputs [batch_size, S] -> logits [batch_size, S, V]`
        (`logits_fn`); the first is the reference of the KL and agreement columns.
      windows: `[N, S+1]` validated windows.
      batch_size, desc, progress: as in `_batches`.
      ce: whether to compute the cross-entropy and top-1 columns.

    Returns:
      (`[len(models), 4]` float64 sums over every predicted token of: cross entropy, correct
      top-1, KL(reference || model), agreement with the reference; predicted token count).
      The reference's own KL is 0 and its agreement the token count, not computed.
    """
    sums = np.zeros((len(models), 4), np.float64)
    for real, batch in _batches(windows, batch_size, desc, progress):
        batch = jnp.asarray(batch)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, S] each
        ref_logits = models[0](inputs)  # [B, S, V]
        for i, logits_of in enumerate(models):
            logits = ref_logits if i == 0 else logits_of(inputs)
            cols = {}
            if ce:
                cols[0], cols[1] = _ce_correct(logits, targets)
            if i > 0:
                cols[2], cols[3] = _kl_agree(ref_logits, logits)
            for j, x in cols.items():
                sums[i, j] += float(np.sum(np.asarray(x, np.float64)[:real]))
    n = windows.shape[0] * (windows.shape[1] - 1)
    sums[0, 3] = n  # the reference agrees with itself everywhere; its KL stays 0
    return sums, n


def lm_stats_paged(
    cfg: ModelConfig,
    params: dict,
    tokens,
    kv_format: str = "int8",
    *,
    block_size: int = 16,
    seq_len: int = EVAL_SEQ_LEN,
    max_tokens: int | None = None,
    batch_size: int = PAGED_BATCH_SIZE,
    backend: str = "auto",
    progress: bool = False,
) -> LMStats:
    """`lm_stats` with serving numerics: every window prefilled through the paged forward.

    Each window is one ragged chunk (logits "all") written into a fresh paged cache of
    `kv_format`; attention reads the cache as stored, so an int8 / fp8 cache is scored as the
    engine runs it. With kv_format="float" the result equals `lm_stats` up to float rounding.

    Args:
      cfg: model config.
      params: params pytree (dense or quantized linears).
      tokens: windows [N, S+1] int, or a stream [N] (see `lm_stats`).
      kv_format: "float" (the model dtype), "int8" or "fp8".
      block_size: tokens per KV block.
      seq_len, max_tokens: as in `lm_stats`.
      batch_size: windows per jitted paged forward.
      backend: attention backend ("auto", "xla", "reference", "pallas", "pallas-interpret").
      progress: show a tqdm bar.

    Returns:
      The LMStats.
    """
    if kv_format is None:
        raise ValueError(f"kv_format={kv_format!r}; expected one of {KV_FORMATS}")
    check_kv_format(kv_format)
    _check_sizes(block_size, batch_size)
    check_params(cfg, params)
    windows = _as_windows(cfg, tokens, seq_len, max_tokens)
    models = [logits_fn(cfg, params, kv_format, block_size, backend, batch_size)]
    sums, n = _score(models, windows, batch_size, f"eval ({kv_format} KV)", progress)
    ce, correct = sums[0, :2]
    return LMStats(num_tokens=n, nll=float(ce / n), accuracy=float(correct / n))


@dataclasses.dataclass(frozen=True)
class ReferenceStats:
    """A model's next-token statistics and its distance to a reference on the same windows."""

    num_tokens: int  # predicted tokens (windows x S)
    nll: float  # mean cross entropy, nats / token
    accuracy: float  # fraction of targets equal to the model's argmax
    kl: float  # mean KL(reference || model) of the next-token distributions, nats / token
    agreement: float  # fraction of positions where the model's argmax equals the reference's

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def compare_to_reference(
    reference: tuple,
    candidates: dict[str, tuple],
    tokens,
    *,
    block_size: int = 16,
    seq_len: int = EVAL_SEQ_LEN,
    max_tokens: int | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    backend: str = "auto",
    progress: bool = False,
) -> tuple[ReferenceStats, dict[str, ReferenceStats]]:
    """Scores a reference and many variants of it in one pass over the windows.

    Each batch's reference logits are computed once and every candidate is compared to them
    (the quality table of a quantization sweep runs the float model once, not once per method).

    Args:
      reference: `(cfg, params)` or `(cfg, params, kv_format)`.
      candidates: name -> `(cfg, params)` or `(cfg, params, kv_format)`; kv_format None (or
        absent) scores with the dense forward, "float" / "int8" / "fp8" through the paged
        forward and a cache of that format (see `lm_stats_paged`). Same vocabulary as the
        reference.
      tokens: windows [N, S+1] int, or a stream [N] (see `lm_stats`).
      block_size: tokens per KV block of the paged candidates.
      seq_len, max_tokens, batch_size, progress: as in `lm_stats`.
      backend: attention backend of the paged candidates.

    Returns:
      (the reference's own stats (kl 0, agreement 1), name -> stats of each candidate).
    """
    _check_sizes(block_size, batch_size)
    specs = {"": reference, **{f"candidate {k!r}": v for k, v in candidates.items()}}
    models = []
    for where, spec in specs.items():
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise ValueError(
                f"{where or 'reference'}: expected (cfg, params) or (cfg, params, kv_format), "
                f"got a {type(spec).__name__}"
            )
        cfg, params, kv = (*spec, None) if len(spec) == 2 else spec
        check_kv_format(kv)
        if cfg.vocab_size != reference[0].vocab_size:
            raise ValueError(
                f"{where}: vocab_size {cfg.vocab_size} differs from the reference's "
                f"{reference[0].vocab_size}"
            )
        try:
            check_params(cfg, params)
        except ValueError as e:
            raise ValueError(f"{where or 'reference'}: {e}") from None
        models.append((cfg, logits_fn(cfg, params, kv, block_size, backend, batch_size)))
    windows = _as_windows(reference[0], tokens, seq_len, max_tokens)
    for cfg, _ in models[1:]:
        _as_windows(cfg, windows, seq_len, None)  # each candidate's limits too
    sums, n = _score([fn for _, fn in models], windows, batch_size, "compare", progress)
    stats = [
        ReferenceStats(num_tokens=n, nll=s[0] / n, accuracy=s[1] / n, kl=s[2] / n,
                       agreement=s[3] / n)
        for s in sums
    ]  # fmt: skip
    return stats[0], dict(zip(candidates, stats[1:]))


# ---------------------------------------------------------------------------------------------
# Unigram baseline
# ---------------------------------------------------------------------------------------------


def unigram_log_probs(train_tokens, vocab_size: int) -> np.ndarray:
    """Add-one smoothed unigram log-probabilities: log((count_v + 1) / (N + V)).

    Args:
      train_tokens: int token ids of any shape (e.g. the train stream).
      vocab_size: V.

    Returns:
      [V] float64.
    """
    ids = np.asarray(train_tokens).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"train_tokens must be integer ids, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"train_tokens hold ids outside [0, {vocab_size})")
    counts = np.bincount(ids, minlength=vocab_size).astype(np.float64)  # [V]
    return np.log(counts + 1.0) - np.log(ids.size + vocab_size)


def unigram_stats(train_tokens, windows, vocab_size: int) -> LMStats:
    """The unigram baseline on the same predicted tokens as `lm_stats(windows)`.

    Args:
      train_tokens: ids the unigram frequencies are counted on (the train split).
      windows: [N, S+1] evaluation windows; the targets `windows[:, 1:]` are scored.
      vocab_size: V.

    Returns:
      LMStats: nll = -mean log p(target); accuracy = fraction of targets equal to the most
      frequent train token.
    """
    log_p = unigram_log_probs(train_tokens, vocab_size)  # [V]
    targets = np.asarray(windows)[:, 1:].reshape(-1)  # [N * S]
    if targets.size == 0:
        raise ValueError("windows hold no targets; expected shape [N, S+1] with S >= 1")
    nll = float(-np.mean(log_p[targets]))
    accuracy = float(np.mean(targets == int(np.argmax(log_p))))
    return LMStats(num_tokens=int(targets.size), nll=nll, accuracy=accuracy)
