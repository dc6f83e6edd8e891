"""Sampling: validation, logits processing against numpy, and the sampled distribution.

Statistical test: chi-square goodness of fit at significance 1e-3, with a negative control
(the same samples against a distribution that ignores the temperature) that must fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from jaxinfer.sampling import (
    MIN_POSITIVE,
    SamplingBatch,
    SamplingParams,
    probs,
    process_logits,
    sample,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=1e-46), "top_p"),  # 0 in float32: kept every token
        (dict(temperature=1e-40), "temperature"),  # logits / T = inf: sampled token 0
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
        (dict(stop_token_ids=3), "stop_token_ids"),
        (dict(seed=-1), "seed"),
        (dict(n=0), "n"),
    ],
)
def test_sampling_params_validation_names_field(kwargs, field):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=") as e:
        SamplingParams(**kwargs)
    assert repr(value) in str(e.value)  # the message names the bad value


def _numpy_declared(logits, t, k, p, min_p):
    """Reference declared distribution (float64): temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64) / t
    v = x.size
    order = np.argsort(-x, kind="stable")
    keep = np.ones(v, bool)
    if k:
        keep &= x >= x[order[k - 1]]
    e = np.where(keep, np.exp(x - x.max()), 0)
    pr = e / e.sum()
    srt = np.argsort(-np.where(keep, x, -np.inf), kind="stable")
    before = np.cumsum(pr[srt]) - pr[srt]
    kept_sorted = srt[before < p]
    thresh = x[kept_sorted].min()
    keep &= x >= thresh
    e = np.where(keep, np.exp(x - x.max()), 0)
    pr = e / e.sum()
    keep &= pr >= min_p * pr.max()
    e = np.where(keep, np.exp(x - x.max()), 0)
    return e / e.sum()


@pytest.mark.parametrize(
    "t, k, p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 10, 0.8, 0.05),
     (1.0, 0, 1.0, 0.2), (0.5, 3, 0.5, 0.0)],
)  # fmt: skip
def test_process_logits_matches_numpy(t, k, p, min_p):
    rng = np.random.RandomState(0)
    logits = rng.randn(4, 32).astype(np.float32) * 2
    sp = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)
    sb = SamplingBatch.from_params([sp] * 4)
    got = np.asarray(probs(jnp.asarray(logits), sb))
    for row in range(4):
        want = _numpy_declared(logits[row], t, k, p, min_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        assert (got[row] > 0).sum() == (want > 0).sum()


def test_greedy_rows_are_argmax_and_unmasked():
    logits = jnp.asarray(np.random.RandomState(1).randn(3, 16), jnp.float32)
    sb = SamplingBatch.from_params(
        [SamplingParams(temperature=0, top_k=2), SamplingParams(), SamplingParams(temperature=0)]
    )
    x = process_logits(logits, sb)
    np.testing.assert_array_equal(np.asarray(x[0]), np.asarray(logits[0]))
    toks = sample(logits, sb, jnp.zeros(3, jnp.int32))
    assert int(toks[0]) == int(jnp.argmax(logits[0])) and int(toks[2]) == int(jnp.argmax(logits[2]))


def test_smallest_temperature_and_top_p_sample_the_argmax():
    """At the smallest accepted temperature / top_p (MIN_POSITIVE), float32 on the device still
    gives the argmax for logits far from 0 (the values below it are refused: test above)."""
    logits = 30 * jnp.asarray(np.random.RandomState(2).randn(4, 64), jnp.float32)  # [B, V]
    want = np.asarray(jnp.argmax(logits, -1))
    for kw in (dict(temperature=MIN_POSITIVE), dict(top_p=MIN_POSITIVE)):
        for seed in range(3):
            sb = SamplingBatch.from_params([SamplingParams(seed=seed, **kw)] * 4)
            got = sample(logits, sb, jnp.arange(4, dtype=jnp.int32))
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(kw))


def _chi2_pvalue(counts, probs_):
    n = counts.sum()
    mask = probs_ > 0
    assert counts[~mask].sum() == 0, "sampled a token outside the allowed set"
    expected = n * probs_[mask]
    stat = ((counts[mask] - expected) ** 2 / expected).sum()
    return float(chi2.sf(stat, mask.sum() - 1))


def test_sampled_distribution_matches_declared():
    """60k draws at distinct positions (independent noise) fit the declared distribution."""
    rng = np.random.RandomState(3)
    logits = rng.randn(16).astype(np.float32)
    sp = SamplingParams(temperature=0.7, top_k=12, top_p=0.95, min_p=0.01, seed=5)
    n = 60_000
    sb = SamplingBatch.from_params([sp] * n)
    toks = jax.jit(sample)(jnp.tile(logits, (n, 1)), sb, jnp.arange(n, dtype=jnp.int32))
    counts = np.bincount(np.asarray(toks), minlength=16)
    declared = _numpy_declared(logits, 0.7, 12, 0.95, 0.01)
    assert _chi2_pvalue(counts, declared) > 1e-3
    # Negative control: the same draws do not fit the distribution without temperature.
    wrong = _numpy_declared(logits, 1.0, 12, 0.95, 0.01)
    assert _chi2_pvalue(counts, wrong) < 1e-3


def test_noise_depends_on_seed_and_position_only():
    logits = jnp.zeros((4, 64), jnp.float32)
    sb = SamplingBatch.from_params([SamplingParams(seed=s) for s in (1, 1, 2, 1)])
    pos = jnp.asarray([7, 7, 7, 8], jnp.int32)
    t = np.asarray(sample(logits, sb, pos))
    assert t[0] == t[1]  # same seed and position: same sample
    one = np.asarray(sample(logits[:1], sb.take(jnp.asarray([0])), pos[:1]))
    assert one[0] == t[0]  # independent of batch neighbours


def _mixed_batch(rows: int):
    """Logits and settings of a batch mixing greedy and sampled rows."""
    logits = jnp.asarray(np.random.RandomState(4).randn(rows, 256), jnp.float32)
    sps = [
        SamplingParams(temperature=0) if r % 3 == 0 else SamplingParams(temperature=1.5, seed=r)
        for r in range(rows)
    ]
    return logits, SamplingBatch.from_params(sps), jnp.arange(10, 10 + rows, dtype=jnp.int32)


def test_sample_index_zero_is_the_default_noise():
    logits, sb, pos = _mixed_batch(6)
    want = np.asarray(sample(logits, sb, pos))
    got = np.asarray(sample(logits, sb, pos, sample_index=jnp.zeros(6, jnp.int32)))
    np.testing.assert_array_equal(got, want)


def test_sample_index_changes_the_noise_of_sampled_rows_only():
    """Index 1 draws other noise than index 0: over 8 flat-ish sampled rows of 256 tokens the
    samples cannot all agree (each agrees by chance with probability ~1/256); greedy rows never
    depend on the index."""
    logits, sb, pos = _mixed_batch(12)
    zero = np.asarray(sample(logits, sb, pos, sample_index=jnp.zeros(12, jnp.int32)))
    one = np.asarray(sample(logits, sb, pos, sample_index=jnp.ones(12, jnp.int32)))
    greedy = np.arange(12) % 3 == 0
    np.testing.assert_array_equal(one[greedy], zero[greedy])
    assert (one[~greedy] != zero[~greedy]).any()


@pytest.mark.parametrize("index", [1, 2, 7])
def test_sample_index_matches_fold_in_construction(index):
    """Sample i > 0 uses `fold_in(fold_in(key(seed), i), position)`, as the engine's forks
    always have; built here from jax.random directly."""
    logits, sb, pos = _mixed_batch(6)
    got = np.asarray(sample(logits, sb, pos, sample_index=jnp.full(6, index, jnp.int32)))
    x = process_logits(logits, sb)
    for r in range(6):
        key = jax.random.fold_in(jax.random.key(int(sb.seed[r])), index)
        g = jax.random.gumbel(jax.random.fold_in(key, int(pos[r])), (logits.shape[-1],))
        want = jnp.argmax(x[r]) if sb.temperature[r] <= 0 else jnp.argmax(x[r] + g)
        assert got[r] == int(want), f"row {r}"


def test_sample_index_shape_is_checked():
    logits, sb, pos = _mixed_batch(4)
    with pytest.raises(ValueError, match="sample_index has shape"):
        sample(logits, sb, pos, sample_index=jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**40),
        ("top_k", 2**31),
        ("stop_token_ids", (1, 2**40)),
        ("max_tokens", 2**31),
        ("seed", 2**40),
        ("n", 2**40),
    ],
)
def test_values_beyond_int32_are_refused_by_name(field, value):
    """Issue 15 cause 2: int32 overflow is a ValueError naming the field, not numpy's."""
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_int32_max_is_accepted_and_packs():
    sp = SamplingParams(top_k=2**31 - 1, stop_token_ids=(2**31 - 1,), max_tokens=2**31 - 1)
    SamplingBatch.from_params([sp])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=np.float32(0.5)),
        dict(temperature=np.float64(0.5)),
        dict(temperature=jnp.float32(0.5)),
        dict(temperature=np.int64(1)),
        dict(top_p=np.float32(0.9)),
        dict(top_p=jnp.float32(0.9)),
        dict(min_p=np.float32(0.05)),
        dict(min_p=jnp.asarray(0.05)),
        dict(top_k=np.int64(5)),
        dict(top_k=jnp.int32(5)),
        dict(max_tokens=np.int32(7)),
        dict(max_tokens=jnp.int32(7)),
        dict(seed=np.uint8(3)),
        dict(seed=jnp.int32(3)),
        dict(n=np.int16(2)),
        dict(stop_token_ids=(np.int64(3), jnp.int32(4))),
        dict(stop_token_ids=np.array([3, 4])),
        dict(stop_token_ids=jnp.array([3, 4], jnp.int32)),
    ],
    ids=lambda kw: f"{next(iter(kw))}={type(next(iter(kw.values()))).__name__}",
)
def test_numpy_and_jax_scalars_are_accepted_as_python_numbers(kwargs):
    """Issue 15 cause 3: np.float32(0.5) and jax scalars are numbers; stored as Python ones."""
    sp = SamplingParams(**kwargs)
    ((field, value),) = kwargs.items()
    got = getattr(sp, field)
    if field == "stop_token_ids":
        assert got == tuple(int(v) for v in np.asarray(value).tolist())
        assert all(type(v) is int for v in got)
    else:
        assert got == pytest.approx(float(np.asarray(value)))
        assert type(got) is (int if field in ("top_k", "max_tokens", "seed", "n") else float)
    SamplingBatch.from_params([sp])
    hash(sp)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=True), "temperature"),
        (dict(top_p=np.bool_(True)), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=np.bool_(True)), "top_k"),
        (dict(top_k=np.float32(3.0)), "top_k"),
        (dict(top_k=jnp.array([3])), "top_k"),
        (dict(max_tokens=jnp.float32(3)), "max_tokens"),
        (dict(seed=False), "seed"),
        (dict(stop_token_ids=(True,)), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
        (dict(temperature=np.float32("nan")), "temperature"),
        (dict(temperature=jnp.array([0.5, 0.5])), "temperature"),
        (dict(temperature="0.5"), "temperature"),
    ],
)
def test_wrong_kind_scalars_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)
