"""build_metadata against a per-chunk numpy reference: ragged chunks, every logits mode, padded
sizes, block tables longer than M, numpy inputs, and the errors (first bad chunk named)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.cache.metadata import NULL_BLOCK, BatchMetadata, SeqChunk, build_metadata


def _reference(chunks, S, t, b, m, n) -> tuple[dict, np.ndarray]:
    """The layout written out chunk by chunk (sizes given; chunks assumed valid)."""
    out = {
        "tokens": np.zeros(t, np.int32),
        "positions": np.zeros(t, np.int32),
        "query_start": np.zeros(b + 1, np.int32),
        "seq_lens": np.zeros(b, np.int32),
        "block_tables": np.full((b, m), NULL_BLOCK, np.int32),
        "slot_mapping": np.full(t, NULL_BLOCK * S, np.int32),
        "logits_indices": np.zeros(n, np.int32),
    }
    owner = np.full(n, -1, np.int32)
    row, li = 0, 0
    for i, c in enumerate(chunks):
        q, end = len(c.token_ids), c.start_pos + len(c.token_ids)
        pos = np.arange(c.start_pos, end)
        table = np.asarray(c.block_table, np.int32)
        out["tokens"][row : row + q] = c.token_ids
        out["positions"][row : row + q] = pos
        out["slot_mapping"][row : row + q] = table[pos // S] * S + pos % S
        out["block_tables"][i, : min(len(table), m)] = table[:m]
        out["seq_lens"][i] = end
        rows = {"all": np.arange(row, row + q), "last": [row + q - 1]}.get(c.logits, [])
        out["logits_indices"][li : li + len(rows)] = rows
        owner[li : li + len(rows)] = i
        li += len(rows)
        row += q
        out["query_start"][i + 1 :] = row
    return out, owner


def _random_chunks(rng, S: int, as_numpy: bool) -> list[SeqChunk]:
    chunks = []
    for _ in range(rng.integers(1, 9)):
        q, start = int(rng.integers(1, 3 * S + 2)), int(rng.integers(0, 4 * S))
        need = -(-(start + q) // S)
        table = rng.permutation(np.arange(1, 200))[: need + rng.integers(0, 3)]  # may be > M
        tokens = rng.integers(0, 5000, q)
        logits = str(rng.choice(["last", "all", "none"]))
        if not as_numpy:
            tokens, table = tokens.tolist(), table.tolist()
        chunks.append(SeqChunk(tokens, start, table, logits))
    return chunks


@pytest.mark.parametrize("S", [1, 4, 16])
@pytest.mark.parametrize("as_numpy", [False, True], ids=["lists", "numpy"])
@pytest.mark.parametrize("padded", [False, True], ids=["default-sizes", "given-sizes"])
def test_build_metadata_matches_reference(S, as_numpy, padded):
    rng = np.random.default_rng([S, as_numpy, padded])
    for _ in range(50):
        chunks = _random_chunks(rng, S, as_numpy)
        total = sum(len(c.token_ids) for c in chunks)
        blocks = max(-(-(c.start_pos + len(c.token_ids)) // S) for c in chunks)
        n_logits = sum(
            len(c.token_ids) if c.logits == "all" else c.logits == "last" for c in chunks
        )
        sizes = {}
        if padded:  # exact or generous sizes, not powers of two
            sizes = dict(
                num_tokens=total + int(rng.integers(0, 5)),
                num_seqs=len(chunks) + int(rng.integers(0, 3)),
                max_blocks=blocks + int(rng.integers(0, 2)),
                num_logits=max(1, n_logits + int(rng.integers(0, 3))),
            )
        meta, owner = build_metadata(chunks, S, **sizes)
        assert isinstance(meta, BatchMetadata)
        t, b, m, n = (len(meta.tokens), len(meta.seq_lens), meta.block_tables.shape[1], len(owner))
        if padded:
            assert (t, b, m, n) == tuple(sizes.values())
        else:
            assert min(t, b, m, n) >= 1 and all(x & (x - 1) == 0 for x in (t, b, m, n))
        want, want_owner = _reference(chunks, S, t, b, m, n)
        for name, w in want.items():
            got = getattr(meta, name)
            assert got.dtype == np.int32 and got.shape == w.shape, name
            np.testing.assert_array_equal(got, w, err_msg=name)
        assert owner.dtype == np.int32
        np.testing.assert_array_equal(owner, want_owner)


@pytest.mark.parametrize(
    "chunks, sizes, match",
    [
        ([], {}, "no sequences"),
        ([SeqChunk([1], 0, [1]), SeqChunk([], 3, [2])], {}, "sequence 1 has no tokens"),
        # The first bad chunk is named, whichever way it is bad.
        ([SeqChunk([1, 2], 7, [1]), SeqChunk([], 0, [2])], {}, "sequence 0 needs 2 blocks"),
        ([SeqChunk([1], 0, [1]), SeqChunk([1, 2, 3], 7, [1])], {}, "sequence 1 needs 2 blocks"),
        ([SeqChunk([1] * 9, 0, [1, 2])], dict(num_tokens=8), "needs T=9"),
        ([SeqChunk([1], 0, [1])] * 3, dict(num_seqs=2), "B=3"),
        ([SeqChunk([1], 20, [1, 2, 3])], dict(max_blocks=2), "M=3"),
        ([SeqChunk([1, 2], 0, [1], "all")], dict(num_logits=1), "N=2"),
    ],
)
def test_build_metadata_errors(chunks, sizes, match):
    with pytest.raises(ValueError, match=match):
        build_metadata(chunks, 8, **sizes)
