"""experiments/train_drafter.py on the tiny shipped target: the first loss values reproduce from
the saved config, and a run interrupted and resumed ends bitwise identical to an uninterrupted
one (params, optimizer state and loss curve); the saved head pairs with its target only."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import train_drafter as td
from jaxinfer.speculative import heads

STEPS = 6


def _tiny(tmp_path, kind, name, **kw) -> td.DrafterTrainConfig:
    return td.DrafterTrainConfig(
        kind=kind, target="target", split="calib", workdir=str(tmp_path / name),
        features_dir=str(tmp_path / "features"), num_tokens=2048, seq_len=32, feature_batch=8,
        topk=8, steps=STEPS, batch_size=4, peak_lr=3e-3, warmup_steps=2, checkpoint_every=2,
        draft_vocab_size=96, num_medusa_heads=3, eagle_intermediate=64, draft_hidden=32,
        draft_layers=1, **kw,
    )  # fmt: skip


def _curve(workdir) -> list[dict]:
    with open(f"{workdir}/loss_curve.jsonl") as f:
        return [json.loads(x) for x in f]


def _final_state(workdir):
    manager = ocp.CheckpointManager(f"{workdir}/checkpoints")
    return manager.restore(manager.latest_step())


@pytest.mark.parametrize("kind", td.KINDS)
def test_rerun_from_saved_config_and_resume_are_bitwise(tmp_path, kind):
    tc = _tiny(tmp_path, kind, "a")
    td.run(tc, progress=False)
    first = _curve(tc.workdir)
    assert [r["step"] for r in first] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in first)

    # The saved config reruns to the same curve (another workdir; the feature cache is reused).
    again = td.load_config(f"{tc.workdir}/config.json", workdir=str(tmp_path / "b"))
    td.run(again, progress=False)
    assert _curve(again.workdir) == first

    # Interrupted after step 3 (between checkpoints at 2 and 4), then resumed.
    cut = dataclasses.replace(tc, workdir=str(tmp_path / "c"), stop_at=3)
    out = td.run(cut, progress=False)
    assert out["steps_done"] == 3 and not out["finished"]
    td.run(dataclasses.replace(cut, stop_at=0), progress=False)
    assert _curve(cut.workdir) == first
    a, c = _final_state(tc.workdir), _final_state(cut.workdir)
    la, lc = jax.tree.leaves(a), jax.tree.leaves(c)
    assert len(la) == len(lc) and all(np.array_equal(x, y) for x, y in zip(la, lc))

    # A seed change changes the curve (the comparisons above can fail).
    other = dataclasses.replace(tc, workdir=str(tmp_path / "d"), seed=1)
    td.run(other, progress=False)
    assert _curve(other.workdir) != first

    # Shipping: the drafter and its record, no machine paths; the shipped config reruns.
    dest = td.ship(tc.workdir, str(tmp_path / "shipped"))
    shipped = json.loads(open(f"{dest}/train_config.json").read())
    assert shipped["workdir"] == shipped["features_dir"] == ""
    assert {k: v for k, v in shipped.items() if k not in ("workdir", "features_dir")} == {
        k: v for k, v in json.loads(open(f"{tc.workdir}/config.json").read()).items()
        if k not in ("workdir", "features_dir")
    }  # fmt: skip
    assert _curve(dest) == first
    if kind != "draft":
        cfg = td.common.model_config("target")
        head = heads.load_head(f"{tc.workdir}/head", cfg)
        assert head.cfg.kind == kind and head.cfg.draft_vocab_size == 96
        with pytest.raises(ValueError, match="num_layers"):
            heads.load_head(f"{tc.workdir}/head", cfg.replace(num_layers=cfg.num_layers + 1))
        small = heads.load_head(dest, cfg)  # float16 on disk, float32 again when loaded
        for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(small.params)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype == np.float32:
                assert b.dtype == np.float32
                assert np.array_equal(b, a.astype(np.float16).astype(np.float32))
            else:
                assert np.array_equal(a, b)
    else:
        assert json.loads(open(f"{dest}/config.json").read()) == json.loads(
            open(f"{tc.workdir}/draft/config.json").read()
        )
    unfinished = dataclasses.replace(tc, workdir=str(tmp_path / "e"), stop_at=1)
    td.run(unfinished, progress=False)
    with pytest.raises(ValueError, match="no finished"):
        td.ship(unfinished.workdir, str(tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kind='tree'"):
        td.run(dataclasses.replace(_tiny(tmp_path, "medusa", "x"), kind="tree"))
    with pytest.raises(ValueError, match="num_tokens=64"):
        td.run(dataclasses.replace(_tiny(tmp_path, "medusa", "x"), num_tokens=64))
