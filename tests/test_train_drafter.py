"""experiments/train_drafter.py on the tiny shipped target: the first loss values reproduce from
the saved config, and a run interrupted and resumed ends bitwise identical to an uninterrupted
one (params, optimizer state and loss curve); the saved head pairs with its target only."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxinfer as ji
from experiments import train_drafter as td
from jaxinfer.model.decoder import forward_dense
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


@pytest.mark.parametrize(
    "kind, chain, fused",
    [(k, False, "") for k in td.KINDS] + [("eagle", True, ""), ("eagle", True, "1,3")],
)
def test_rerun_from_saved_config_and_resume_are_bitwise(tmp_path, kind, chain, fused):
    tc = _tiny(tmp_path, kind, "a", chain_attention=chain, feature_layers=fused)
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
    if chain and not fused:  # and the drafting-shaped attention is what this run trained
        plain = dataclasses.replace(tc, workdir=str(tmp_path / "f"), chain_attention=False)
        td.run(plain, progress=False)
        got = _curve(plain.workdir)
        assert got[0]["ce0"] == first[0]["ce0"]  # step 0 is the same form
        assert got[0]["ce1"] != first[0]["ce1"]

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
        assert head.cfg.feature_layers == ((1, 3) if fused else None)
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
    with pytest.raises(ValueError, match="feature_layers='1,x'; expected comma-separated"):
        td.run(_tiny(tmp_path, "eagle", "x", feature_layers="1,x"))
    with pytest.raises(ValueError, match=r"feature_layers=\(1, 3\) is for kind='eagle'"):
        td.run(_tiny(tmp_path, "medusa", "x", feature_layers="1,3"))
    with pytest.raises(ValueError, match=r"feature_layers=\(1, 2\) must end with"):
        td.run(_tiny(tmp_path, "eagle", "x", feature_layers="1,2"))  # the target has 4 layers
    assert not (tmp_path / "features").exists()  # refused before any feature was made


def test_fused_features_are_the_layers_outputs(tmp_path):
    """--feature_layers caches those layers' outputs (the last layer's last, as the plain cache
    holds it), under another key."""
    base = _tiny(tmp_path, "eagle", "p")
    tc = dataclasses.replace(base, feature_layers="1,3")
    cfg, params, path = td.common.load_model("target")
    tokenizer = ji.load_tokenizer(path)
    plain = td.teacher_features(base, cfg, params, tokenizer, path)
    feats = td.teacher_features(tc, cfg, params, tokenizer, path)
    assert td._feature_key(tc, path) != td._feature_key(base, path)
    e = cfg.hidden_size
    assert feats["hidden"].shape == (*plain["hidden"].shape[:2], 2 * e)
    assert np.array_equal(feats["hidden"][..., e:], plain["hidden"])
    cut = dict(params, layers=jax.tree.map(lambda a: a[:2], params["layers"]))
    _, h1 = forward_dense(cut, cfg.replace(num_layers=2), jnp.asarray(plain["tokens"][:2]),
                          return_hidden=True)  # fmt: skip
    want = np.asarray(h1, np.float16).astype(np.float32)  # layer 1's output, as cached
    got = np.asarray(feats["hidden"][:2, :, :e], np.float32)
    np.testing.assert_allclose(got, want, atol=1e-2)
    big = dict(params, embed=params["embed"] * 1e6)  # outputs past float16's range
    with pytest.raises(ValueError, match="windows 0..7 overflow float16"):
        td.teacher_features(dataclasses.replace(tc, features_dir=str(tmp_path / "big")), cfg,
                            big, tokenizer, path)  # fmt: skip
    assert not (tmp_path / "big").exists() or not any((tmp_path / "big").rglob("*.npy"))


def test_generated_windows_are_the_targets_greedy_continuations(tmp_path):
    """Self-distillation windows: a split prompt, then exactly what plain greedy decoding of the
    target gives for it; the corpus windows come first, unchanged, and the cache key differs."""
    base = _tiny(tmp_path, "eagle", "g0")
    tc = dataclasses.replace(base, workdir=str(tmp_path / "g1"), generated_windows=3,
                             prompt_len=8, generate_batch=2)  # fmt: skip
    cfg, params, path = td.common.load_model("target")
    tokenizer = ji.load_tokenizer(path)
    plain = td.teacher_features(base, cfg, params, tokenizer, path)
    feats = td.teacher_features(tc, cfg, params, tokenizer, path)
    assert td._feature_key(tc, path) != td._feature_key(base, path)
    n = plain["tokens"].shape[0]
    assert feats["tokens"].shape == (n + 3, tc.seq_len)
    assert np.array_equal(feats["tokens"][:n], plain["tokens"])
    assert np.array_equal(feats["top_ids"][:n], plain["top_ids"])
    gen = np.asarray(feats["tokens"][n:])
    prompts = [row[: tc.prompt_len].tolist() for row in gen]
    assert len({tuple(p) for p in prompts}) == 3  # distinct prompts, from the split
    stream = td.common.split_stream(tokenizer, cfg, tc.split)
    assert all(
        any(np.array_equal(stream[a : a + 8], p) for a in range(n * tc.seq_len, stream.shape[0]))
        for p in prompts
    )
    sp = ji.SamplingParams(temperature=0.0, max_tokens=tc.seq_len - 8, ignore_eos=True)
    for row, p in zip(gen, prompts):
        (out,) = ji.generate(cfg, params, [p], sp)
        assert row[8:].tolist() == out.token_ids
    # The teacher's labels on the generated part are the target's: its argmax is the next
    # generated token (greedy), wherever the top-1 is not a near-tie in float16.
    top = np.asarray(feats["top_ids"][n:, 8 - 1 : -1, 0])
    agree = (top == gen[:, 8:]).mean()
    assert agree > 0.97, agree
    with pytest.raises(ValueError, match="prompt_len=32"):
        td.run(dataclasses.replace(tc, prompt_len=32))
    with pytest.raises(ValueError, match="generated_windows=-1"):
        td.run(dataclasses.replace(tc, generated_windows=-1))
    with pytest.raises(ValueError, match="generated_windows=10000000: the split has"):
        td.run(dataclasses.replace(tc, generated_windows=10**7))  # refused before generating
