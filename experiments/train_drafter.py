r"""Trains a learned drafter for a frozen target: Medusa heads, an EAGLE-style head, or a
distilled draft model.

    python -m experiments.train_drafter --kind=medusa --target=smollm2-135m \
        --workdir=/tmp/drafters/medusa --features_dir=/tmp/drafters/features
    python -m experiments.train_drafter --kind=eagle --target=smollm2-135m ...
    python -m experiments.train_drafter --config=/tmp/drafters/medusa/config.json  # rerun

1. **Teacher features, once.** The target's compiled dense forward (`forward_dense(...,
   return_hidden=True)`) runs over non-overlapping windows of a corpus split; per position it
   yields the last layer's feature (float16 on disk) and the teacher's soft label, its top-k
   next-token probabilities at temperature 1 (ids and float16 probs). With
   `--generated_windows`, more windows follow the corpus ones: a prompt from the split and the
   target's own greedy continuation of it (self-distillation: the head learns the text it will
   draft for, the target's, loops and all). They are cached under
   `--features_dir`, keyed by target, split, window and token count, and reused by every run
   and every kind. Keeping the top-k instead of the full 49,152-way distribution is what makes
   the cache small (k = 16: 96 bytes a position against 196 kB).
2. **Training.** Loss: soft cross-entropy to the teacher's top-k (renormalised over the ids
   the drafter can emit), plus for EAGLE a smooth-L1 regression of its predicted feature on the
   target's (EAGLE-1's pair of losses). EAGLE is unrolled `--unroll` steps: step k feeds the
   features predicted at step k−1 in place of the real ones (what drafting does after its
   first token) and weighs 0.8^k, EAGLE's schedule; Medusa head k weighs 0.8^k likewise.
   With `--chain_attention` step k's rows also attend as drafting's k-th step does: to the
   rows written from real features up to the cycle's start and to the cycle's own earlier
   steps (`heads.eagle.eagle_dense_chain`, EAGLE-3's training-time test); without it every
   row of step k attends to step k's rows, a context drafting never sees. With
   `--feature_layers` (EAGLE-3) the cache holds those layers' outputs and the head learns to
   fuse them (`heads.fuse_features`); its predictions still regress on the last layer's.
   AdamW, warm-up then cosine decay, gradient clipping at 1.
3. **Reproducible and resumable.** Window order is a function of (seed, step) only; orbax
   checkpoints hold params, optimizer state and step; `loss_curve.jsonl` has one line per
   step, cut back to the restored step on resume, so an interrupted run resumed (`--stop_at`
   simulates the interruption) ends bitwise identical to an uninterrupted one.

Writes into --workdir: config.json, checkpoints/, loss_curve.jsonl, loss_curve.png,
results.json, and the drafter: head/ (`heads.save_head`) or draft/ (an HF checkpoint dir).
`--ship_to=jaxinfer/assets/models/<name>` then copies the drafter and its record there (`ship`),
which is how the shipped heads were made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags
from tqdm import tqdm

import jaxinfer as ji
from experiments import common
from jaxinfer.model.decoder import forward_dense
from jaxinfer.model.layers import rms_norm
from jaxinfer.model.params import init_params
from jaxinfer.ops.linear import linear
from jaxinfer.speculative import heads
from jaxinfer.train import plot_curve

KINDS = ("medusa", "eagle", "draft")
STEP_DECAY = 0.8  # EAGLE / Medusa weight of the k-th step ahead


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """One training run (saved as config.json; `run(load_config(path))` repeats it)."""

    kind: str = "medusa"
    target: str = "smollm2-135m"  # a ji.models name or a checkpoint path
    workdir: str = ""
    features_dir: str = ""  # teacher cache; "" = <workdir>/features
    split: str = "train"  # corpus split the features come from
    num_tokens: int = 131072  # teacher positions to cache (windows of seq_len)
    seq_len: int = 256
    # Self-distillation (SpecForge's advice): this many more windows, each a prompt of
    # prompt_len split tokens followed by the target's own greedy continuation.
    generated_windows: int = 0
    prompt_len: int = 64
    generate_batch: int = 64  # prompts per ji.generate call (not in the cache key: keep it)
    feature_batch: int = 16  # windows per compiled teacher forward
    topk: int = 16  # teacher soft-label entries kept per position
    steps: int = 300
    batch_size: int = 8  # windows per training step
    peak_lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0
    checkpoint_every: int = 50
    draft_vocab_size: int = 8192  # 0: the full vocabulary (medusa / eagle)
    num_medusa_heads: int = 4
    eagle_intermediate: int = 0  # 0: the target's intermediate size
    unroll: int = 2  # EAGLE steps unrolled in the loss
    # True: unrolled steps attend as drafting does (`heads.eagle.eagle_dense_chain`, EAGLE-3's
    # training-time test); False: every row of step k reads step k-1's predictions (the first
    # heads were trained so; drafting never sees such context rows).
    chain_attention: bool = False
    # EAGLE-3's fused features: target layers whose outputs the head reads, e.g. "2,15,29"
    # (increasing, the last layer last; `HeadConfig.feature_layers`); "" reads the last alone.
    feature_layers: str = ""
    reg_weight: float = 0.1  # EAGLE feature regression weight beside the soft CE (weight 1)
    draft_hidden: int = 128  # the distilled draft model's shape
    draft_layers: int = 2
    stop_at: int = 0  # > 0: stop after this step (simulates an interruption; not in the key)


def load_config(path: str, **overrides) -> DrafterTrainConfig:
    """The config saved by a run (`<workdir>/config.json`), with overrides."""
    saved = json.loads(Path(path).read_text())
    return DrafterTrainConfig(**{**saved, **overrides})


def _check(tc: DrafterTrainConfig) -> None:
    if tc.kind not in KINDS:
        raise ValueError(f"kind={tc.kind!r}; expected one of {KINDS}")
    if not tc.workdir:
        raise ValueError("workdir must be set")
    for name in ("num_tokens", "seq_len", "feature_batch", "topk", "steps", "batch_size",
                 "checkpoint_every", "num_medusa_heads", "unroll", "generate_batch"):  # fmt: skip
        if getattr(tc, name) < 1:
            raise ValueError(f"{name}={getattr(tc, name)!r}; expected >= 1")
    if tc.generated_windows < 0:
        raise ValueError(f"generated_windows={tc.generated_windows!r}; expected >= 0")
    if tc.generated_windows and not 1 <= tc.prompt_len < tc.seq_len:
        raise ValueError(f"prompt_len={tc.prompt_len!r}; expected in [1, seq_len={tc.seq_len})")
    if tc.feature_layers:
        try:
            layers = feature_layers(tc)
        except ValueError:
            raise ValueError(
                f"feature_layers={tc.feature_layers!r}; expected comma-separated layer indices"
            ) from None
        if tc.kind != "eagle":
            raise ValueError(f"feature_layers={layers} is for kind='eagle', not {tc.kind!r}")
    if tc.num_tokens < tc.seq_len * tc.batch_size:
        raise ValueError(
            f"num_tokens={tc.num_tokens} holds fewer than batch_size={tc.batch_size} windows "
            f"of seq_len={tc.seq_len}"
        )


def feature_layers(tc: DrafterTrainConfig) -> tuple[int, ...] | None:
    """`tc.feature_layers` as `HeadConfig.feature_layers` (None: the last layer alone)."""
    return tuple(int(i) for i in tc.feature_layers.split(",")) if tc.feature_layers else None


# ---------------------------------------------------------------------------------------------
# Teacher features (computed once, cached on disk).
# ---------------------------------------------------------------------------------------------

FEATURE_FILES = ("tokens", "hidden", "top_ids", "top_probs")


def _feature_key(tc: DrafterTrainConfig, path: str) -> str:
    what = [os.path.abspath(path), tc.split, tc.num_tokens, tc.seq_len, tc.topk]
    if tc.generated_windows:
        what += [tc.generated_windows, tc.prompt_len]
    if tc.feature_layers:  # hidden holds these layers' outputs
        what += [list(feature_layers(tc))]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]


def generated_windows(tc: DrafterTrainConfig, cfg, params, stream: np.ndarray, start: int):
    """`[generated_windows, seq_len]` int32: prompts of prompt_len tokens spread evenly over
    `stream[start:]` (the part the corpus windows leave), each followed by the target's greedy
    continuation (eos ignored, so every window is whole). Deterministic: greedy, fixed prompts."""
    n, rest = tc.generated_windows, stream.shape[0] - start
    stride = (rest - tc.prompt_len) // max(n, 1)
    if stride < 1:
        raise ValueError(
            f"generated_windows={n}: the split has {rest} tokens left after the corpus windows, "
            f"too few for {n} distinct prompts of {tc.prompt_len}"
        )
    at = start + stride * np.arange(n)
    prompts = [stream[a : a + tc.prompt_len].tolist() for a in at]
    sp = ji.SamplingParams(temperature=0.0, max_tokens=tc.seq_len - tc.prompt_len, ignore_eos=True)
    rows, gb = [], tc.generate_batch
    for i in tqdm(range(0, n, gb), desc="target continuations", unit="batch"):
        chunk = prompts[i : i + gb]
        pad = {"seqs": gb} if len(chunk) < gb and n > gb else None  # one compiled batch size
        for p, out in zip(chunk, ji.generate(cfg, params, chunk, sp, pad_to=pad)):
            if out.finish_reason != "length":
                raise RuntimeError(f"continuation of prompt at {len(rows)} ended: {out.error}")
            rows.append(p + out.token_ids)
    return np.asarray(rows, np.int32).reshape(n, tc.seq_len)


def teacher_features(tc: DrafterTrainConfig, cfg, params, tokenizer, path: str) -> dict:
    """{"tokens" [N, S] int32, "hidden" [N, S, E] f16 ([N, S, n·E]: the `feature_layers`),
    "top_ids" [N, S, k] int32, "top_probs" [N, S, k] f16}, read from the cache or computed (and
    cached) now. N counts the corpus windows, then the `generated_windows`."""
    root = Path(tc.features_dir or os.path.join(tc.workdir, "features"))
    folder = root / _feature_key(tc, path)
    if all((folder / f"{n}.npy").is_file() for n in FEATURE_FILES):
        return {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in FEATURE_FILES}
    stream = common.split_stream(tokenizer, cfg, tc.split)
    n_win = min(tc.num_tokens, stream.shape[0]) // tc.seq_len
    if n_win < tc.batch_size:
        raise ValueError(f"split {tc.split!r} gives {n_win} windows of {tc.seq_len} tokens")
    windows = stream[: n_win * tc.seq_len].reshape(n_win, tc.seq_len).astype(np.int32)
    if tc.generated_windows:
        gen = generated_windows(tc, cfg, params, stream, n_win * tc.seq_len)
        windows = np.concatenate([windows, gen])
        n_win = windows.shape[0]

    @jax.jit
    def teach(tokens):  # [b, S] -> hidden [b, S, E], top-k ids and probs [b, S, k]
        want = feature_layers(tc) or True
        logits, hidden = forward_dense(params, cfg, tokens, return_hidden=want)
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), tc.topk)
        return hidden.astype(jnp.float16), ids.astype(jnp.int32), probs.astype(jnp.float16)

    fb = tc.feature_batch
    pad = (-n_win) % fb
    padded = np.concatenate([windows, np.zeros((pad, tc.seq_len), np.int32)])
    parts = []
    for i in tqdm(range(0, padded.shape[0], fb), desc="teacher features", unit="batch"):
        parts.append(jax.device_get(teach(padded[i : i + fb])))
        if not np.all(np.isfinite(parts[-1][0])):  # a layer's outputs past float16's 65,504
            raise ValueError(
                f"teacher features of windows {i}..{i + fb - 1} overflow float16 "
                f"(feature_layers={tc.feature_layers!r}): choose other layers"
            )
    out = {"tokens": windows}
    for j, name in enumerate(FEATURE_FILES[1:]):
        out[name] = np.concatenate([p[j] for p in parts])[:n_win]
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, arr in out.items():
        np.save(tmp / f"{name}.npy", arr)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)  # whole or absent: a killed run leaves no half cache
    return out


def frequent_tokens(tokens: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """The n most frequent ids of `tokens` (ties: smaller id first) -> `[n]` int32, sorted."""
    counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))
    return np.sort(order[:n]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Losses (pure; one per kind).
# ---------------------------------------------------------------------------------------------


def soft_ce(logits: jax.Array, ids: jax.Array, p: jax.Array) -> jax.Array:
    """−Σ p̃ log softmax(logits)[ids]: `logits [..., N]`, `ids [..., k]` (−1: not emittable),
    `p [..., k]`, p̃ = p renormalised over the emittable ids -> `[...]` (0 where none is)."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ok = ids >= 0
    w = jnp.where(ok, p.astype(jnp.float32), 0.0)
    w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-9)
    picked = jnp.take_along_axis(logq, jnp.maximum(ids, 0), axis=-1)
    return -jnp.sum(jnp.where(ok, w * picked, 0.0), axis=-1)


def _sub_logits(rp, hcfg, feat):
    """Logits over the draft vocabulary only (`[..., N]`; no -inf scatter, cheaper)."""
    return linear(rms_norm(feat, rp["final_norm"], hcfg.rms_norm_eps), rp["lm_w"])


def _shift(x: jax.Array) -> jax.Array:
    """`[B, S, E]` -> the previous position's row, zeros at 0."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def medusa_loss(hp, frozen, hcfg, batch):
    rp = dict(frozen, head=hp)
    h = batch["hidden"].astype(jnp.float32)  # [B, S, E]
    feats = heads.medusa_features(hp, h)  # [B, S, K, E]
    total, parts = 0.0, {}
    s = h.shape[1]
    for k in range(hcfg.num_medusa_heads):  # head k at t predicts the token after t+k+1
        logits = _sub_logits(rp, hcfg, feats[:, : s - k - 1, k])  # [B, S-k-1, N]
        ce = soft_ce(logits, batch["sub_ids"][:, k + 1 :], batch["top_probs"][:, k + 1 :]).mean()
        total = total + STEP_DECAY**k * ce
        parts[f"ce{k}"] = ce
    return total, parts


def eagle_loss(hp, frozen, hcfg, batch, unroll: int, reg_weight: float, chain: bool = False):
    rp = dict(frozen, head=hp)
    raw = batch["hidden"].astype(jnp.float32)  # [B, S, E] ([B, S, n·E]: fused, last layer last)
    h = raw[..., -hcfg.target_hidden_size :]  # [B, S, E] targets h_t
    prev = _shift(heads.fuse_features(rp, hcfg, raw))  # step 0 reads the target's features
    chained = (
        heads.eagle.eagle_dense_chain(rp, hcfg, batch["tokens"], prev, unroll) if chain else None
    )
    total, parts = 0.0, {}
    for k in range(unroll):  # step k reads the features predicted at step k-1
        pred = chained[k] if chain else heads.eagle_dense(rp, hcfg, batch["tokens"], prev)
        ce = soft_ce(_sub_logits(rp, hcfg, pred), batch["sub_ids"], batch["top_probs"])  # [B, S]
        reg = optax.huber_loss(pred, h)  # [B, S, E]
        if chain:  # a chained step k has a drafting cycle at positions >= k only
            w = (jnp.arange(h.shape[1]) >= k).astype(jnp.float32)  # [S]
            n = w.sum() * h.shape[0]
            ce, reg = ce.sum(0) @ w / n, reg.mean(-1).sum(0) @ w / n
        else:
            ce, reg = ce.mean(), reg.mean()
        total = total + STEP_DECAY**k * (ce + reg_weight * reg)
        parts[f"ce{k}"], parts[f"reg{k}"] = ce, reg
        prev = _shift(pred)
    return total, parts


def draft_loss(dp, dcfg, batch):
    logits = forward_dense(dp, dcfg, batch["tokens"])  # [B, S, V]
    ce = soft_ce(logits, batch["top_ids"], batch["top_probs"]).mean()
    return ce, {"ce0": ce}


# ---------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------


def _draft_config(tc, cfg):
    e = tc.draft_hidden
    return ji.ModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=e, num_layers=tc.draft_layers,
        num_heads=max(e // 32, 1), num_kv_heads=1, head_dim=32, intermediate_size=3 * e,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
    )  # fmt: skip


def _head_config(tc, cfg, vocab_ids):
    over = {"draft_vocab_size": None if vocab_ids is None else int(vocab_ids.shape[0])}
    if tc.kind == "medusa":
        over["num_medusa_heads"] = tc.num_medusa_heads
    if tc.eagle_intermediate:
        over["intermediate_size"] = tc.eagle_intermediate
    if tc.feature_layers:
        over["feature_layers"] = feature_layers(tc)
    return heads.head_config_for(cfg, tc.kind, **over)


def batch_indices(tc: DrafterTrainConfig, step: int, num_windows: int) -> np.ndarray:
    """Windows of step `step`: a fixed function of (seed, step) -> `[batch_size]`."""
    per_epoch = num_windows // tc.batch_size
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([tc.seed, epoch]).permutation(num_windows)
    return np.sort(perm[i * tc.batch_size : (i + 1) * tc.batch_size])


def run(tc: DrafterTrainConfig, progress: bool = True) -> dict:
    """Trains (or resumes) the drafter of `tc`; returns the results dict (also results.json)."""
    _check(tc)
    os.makedirs(tc.workdir, exist_ok=True)
    saved = {k: v for k, v in dataclasses.asdict(tc).items() if k != "stop_at"}
    Path(tc.workdir, "config.json").write_text(json.dumps(saved, indent=2))
    cfg, tparams, path = common.load_model(tc.target, dtype=jnp.float32)
    if tc.kind != "draft":  # a bad head shape is refused before the features are made
        _head_config(tc, cfg, None)
    tokenizer = ji.load_tokenizer(path)
    feats = teacher_features(tc, cfg, tparams, tokenizer, path)
    n_win = feats["tokens"].shape[0]

    vocab_ids = None
    if tc.kind != "draft" and 0 < tc.draft_vocab_size < cfg.vocab_size:
        vocab_ids = frequent_tokens(feats["tokens"], tc.draft_vocab_size, cfg.vocab_size)
    to_sub = np.full(cfg.vocab_size, -1, np.int32)  # full id -> draft-vocabulary index
    if vocab_ids is None:
        to_sub = np.arange(cfg.vocab_size, dtype=np.int32)
    else:
        to_sub[vocab_ids] = np.arange(vocab_ids.shape[0], dtype=np.int32)

    key = jax.random.key(tc.seed)
    if tc.kind == "draft":
        dcfg = _draft_config(tc, cfg)
        params = init_params(dcfg, key)
        loss_fn = lambda p, b: draft_loss(p, dcfg, b)  # noqa: E731
    else:
        hcfg = _head_config(tc, cfg, vocab_ids)
        init = heads.init_medusa if tc.kind == "medusa" else heads.init_eagle
        params = init(hcfg, key)  # float leaves only; vocab_ids join at save time
        extra = {} if vocab_ids is None else {"vocab_ids": jnp.asarray(vocab_ids)}
        frozen = heads.pair(heads.Head(hcfg, dict(params, **extra)), cfg, tparams)
        frozen.pop("head")
        if tc.kind == "medusa":
            loss_fn = lambda p, b: medusa_loss(p, frozen, hcfg, b)  # noqa: E731
        else:
            loss_fn = lambda p, b: eagle_loss(  # noqa: E731
                p, frozen, hcfg, b, tc.unroll, tc.reg_weight, tc.chain_attention
            )

    sched = optax.warmup_cosine_decay_schedule(
        0.0, tc.peak_lr, max(tc.warmup_steps, 1), max(tc.steps, tc.warmup_steps + 1)
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))

    def step_fn(params, opt_state, batch):
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, parts

    step_jit = jax.jit(step_fn)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
    manager = ocp.CheckpointManager(
        Path(tc.workdir).resolve() / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )
    if manager.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    start = int(state["step"])
    curve_path = Path(tc.workdir, "loss_curve.jsonl")
    curve = [json.loads(x) for x in curve_path.read_text().splitlines()] if start else []
    curve = [r for r in curve if r["step"] <= start]
    end = tc.steps if tc.stop_at <= 0 else min(tc.steps, tc.stop_at)
    params, opt_state = state["params"], state["opt_state"]
    t0 = time.perf_counter()
    bar = tqdm(range(start, end), desc=f"train {tc.kind}", disable=not progress)
    for s in bar:
        idx = batch_indices(tc, s, n_win)
        top_ids = np.asarray(feats["top_ids"][idx])
        batch = {
            "tokens": jnp.asarray(feats["tokens"][idx]),
            "hidden": jnp.asarray(feats["hidden"][idx]),
            "top_ids": jnp.asarray(top_ids),
            "sub_ids": jnp.asarray(to_sub[top_ids]),
            "top_probs": jnp.asarray(feats["top_probs"][idx]),
        }
        params, opt_state, loss, parts = step_jit(params, opt_state, batch)
        rec = {"step": s + 1, "loss": float(loss), **{k: float(v) for k, v in parts.items()}}
        curve.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        if (s + 1) % tc.checkpoint_every == 0 or s + 1 == end:
            state = {"params": params, "opt_state": opt_state, "step": jnp.int32(s + 1)}
            manager.save(s + 1, args=ocp.args.StandardSave(state))
            manager.wait_until_finished()
            curve_path.write_text("".join(json.dumps(r) + "\n" for r in curve))
    manager.wait_until_finished()
    curve_path.write_text("".join(json.dumps(r) + "\n" for r in curve))
    if curve:
        plot_curve(curve, Path(tc.workdir, "loss_curve.png"), title=f"{tc.kind} drafter")
    done = end == tc.steps
    if done:
        if tc.kind == "draft":
            ji.save_checkpoint(os.path.join(tc.workdir, "draft"), dcfg, params, tokenizer=tokenizer)
        else:
            hp = dict(params, **extra)
            heads.save_head(os.path.join(tc.workdir, "head"), heads.Head(hcfg, hp))
    results = {
        "kind": tc.kind, "steps_done": end, "finished": done, "windows": int(n_win),
        "generated_windows": tc.generated_windows,
        "tokens": int(n_win * tc.seq_len), "final_loss": curve[-1]["loss"] if curve else None,
        "train_s_this_call": time.perf_counter() - t0, "load_average": common.load_average(),
    }  # fmt: skip
    common.write_json(tc.workdir, "results.json", results)
    return results


# Where a run's record goes when it is shipped (files copied as they are, config renamed).
RECORD_FILES = ("loss_curve.jsonl", "loss_curve.png", "results.json")


def ship(workdir: str, dest: str) -> str:
    """Copies a finished run's drafter and training record into folder `dest` (replaced whole):
    a head as `head_config.json` + `head.safetensors` with float16 weights (`load_head` returns
    float32), a draft model as its HF checkpoint files; beside it `train_config.json` (the run's
    config.json with its workdir and features_dir cleared: machine paths, set anew on a rerun)
    and the loss curve and results. Returns dest."""
    src = Path(workdir)
    saved = json.loads((src / "config.json").read_text())
    kind = saved["kind"]
    made = src / ("draft" if kind == "draft" else "head")
    if not made.is_dir():
        raise ValueError(f"{str(src)!r} holds no finished {kind} run ({made.name}/ is missing)")
    out = Path(dest)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "draft":
        shutil.copytree(made, tmp)
    else:
        heads.save_head(tmp, heads.load_head(made), dtype=np.float16)
    (tmp / "train_config.json").write_text(
        json.dumps(dict(saved, workdir="", features_dir=""), indent=2)
    )
    for name in RECORD_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)  # whole or absent
    return str(out)


# ---------------------------------------------------------------------------------------------
# absl main.
# ---------------------------------------------------------------------------------------------

_DEFAULTS = DrafterTrainConfig()
_POSITIVE = ("num_tokens", "seq_len", "feature_batch", "topk", "steps", "batch_size",
             "checkpoint_every", "num_medusa_heads", "unroll", "draft_hidden",
             "draft_layers", "prompt_len", "generate_batch")  # fmt: skip
_FLAGS: dict = {}


def define_flags() -> None:
    """One flag per DrafterTrainConfig field (None: keep the config's), and --config.

    Defined when run as a script only: the tests import this module for `run` and
    `load_config`, beside other experiments whose flags (--workdir, ...) share absl's registry.
    """
    _FLAGS["config"] = common.config_flag()  # a saved config.json to rerun (flags override)
    _FLAGS["ship_to"] = flags.DEFINE_string(
        "ship_to", None, "After a finished run, copy the drafter and its record here (`ship`), "
        "e.g. jaxinfer/assets/models/<name>; not part of the saved config."
    )  # fmt: skip
    for f in dataclasses.fields(DrafterTrainConfig):
        d = getattr(_DEFAULTS, f.name)
        help_ = f"DrafterTrainConfig.{f.name} (default {d!r})"
        if f.name == "kind":
            _FLAGS[f.name] = flags.DEFINE_enum("kind", None, KINDS, help_)
        elif isinstance(d, bool):
            _FLAGS[f.name] = flags.DEFINE_bool(f.name, None, help_)
        elif isinstance(d, int):
            low = 1 if f.name in _POSITIVE else 0
            _FLAGS[f.name] = flags.DEFINE_integer(f.name, None, help_, lower_bound=low)
        elif isinstance(d, float):
            _FLAGS[f.name] = flags.DEFINE_float(f.name, None, help_, lower_bound=0.0)
        else:
            _FLAGS[f.name] = flags.DEFINE_string(f.name, None, help_)


def main(argv):
    del argv
    config = _FLAGS["config"].value
    base = load_config(config) if config else _DEFAULTS
    extra = ("config", "ship_to")
    over = {k: f.value for k, f in _FLAGS.items() if k not in extra and f.value is not None}
    tc = dataclasses.replace(base, **over)
    results = run(tc)
    if _FLAGS["ship_to"].value and results["finished"]:
        results["shipped_to"] = ship(tc.workdir, _FLAGS["ship_to"].value)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
