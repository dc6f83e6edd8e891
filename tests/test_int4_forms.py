"""experiments/int4_forms.py: its correct forms compute the Q4_1 product they are timed as."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import int4_forms as f4
from jaxinfer import qtensor


def _weight(d_in: int, d_out: int, mins: bool, seed: int = 0) -> qtensor.Int4Weight:
    rng = np.random.default_rng(seed)
    g = 32
    q = jnp.asarray(rng.integers(0, 16, (d_in, d_out)), jnp.int32)
    s = jnp.asarray(rng.uniform(0.01, 0.1, (d_in // g, d_out)), jnp.float32)
    z = jnp.asarray(rng.integers(0, 16, (d_in // g, d_out)), jnp.int32)
    m = jnp.asarray(rng.uniform(-0.5, 0.5, (d_in // g, d_out)), jnp.float32) if mins else None
    return qtensor.make_int4(q, s, z * (not mins), bits=4, group_size=g, mins=m)


@pytest.mark.parametrize("mins", [True, False], ids=["q4_1", "zero_points"])
@pytest.mark.parametrize(
    "form", ["float32", "blocked", "factored", "nibbles_i8", "nt_rows", "bytes_nt"]
)
def test_form_equals_the_dequantized_product(form, mins):
    w = _weight(128, 192, mins)
    x = jax.random.normal(jax.random.key(1), (3, 128), jnp.float32)
    want = np.asarray(x @ qtensor.dequantize(w, jnp.float32))
    got = np.asarray(f4.product(form, x, f4.form_weights(form, w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_check_refuses_a_wrong_form():
    w = _weight(576, 192, mins=True)
    layer = {name: w for name in f4.PROJ}
    laid = {name: f4.form_weights("nibbles_i8", w) for name in f4.PROJ}
    assert f4.check("nibbles_i8", layer, laid, rows=2) < 1e-4
    packed, s, m = laid["wq"]
    laid["wq"] = (packed, s, m + 1e-3)  # every offset off by 1e-3
    with pytest.raises(AssertionError, match="nibbles_i8: wq at 2 rows differs"):
        f4.check("nibbles_i8", layer, laid, rows=2)
