"""Training and distillation of the small embedded models: losses, train state, jitted step, loop.

One step is `forward_dense` on a batch of random windows of the training stream, a next-token
cross entropy (or, for a draft, a forward KL to a teacher's next-token distribution, optionally
mixed with the cross entropy), AdamW with linear warm-up, cosine decay and global-norm clipping.

Exact resumption: a step's batch is a pure function of (seed, step) (`batch_for_step`), and an
orbax checkpoint holds the whole `TrainState` (step, params, optimizer state), so a run that is
interrupted and restarted from its last checkpoint replays the same batches on the same state and
ends with bitwise the same params as a run that never stopped.

Host side: the loop, data and logging (numpy, tqdm, orbax). Device side: `make_train_step`'s jitted
step, which donates the state so params and moments are updated in place, and `make_eval_fn`.
The host syncs with the device only every `log_every` steps (to read losses), so dispatch runs
ahead of compute the rest of the time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import ModelConfig
from jaxinfer.data import random_windows
from jaxinfer.losses import distill_kl, lm_loss, token_cross_entropy
from jaxinfer.model.decoder import forward_dense
from jaxinfer.model.params import init_params
from jaxinfer.ops.backend import resolve_backend

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; experiment configs fill it with commented values."""

    name: str  # run name, e.g. "target", "draft", "tiny"
    model: ModelConfig  # architecture of the trained model
    seq_len: int = 256  # tokens per training window (inputs; targets are shifted by one)
    batch_size: int = 16  # windows per step
    steps: int = 1000  # total optimizer steps; the cosine schedule ends here
    peak_lr: float = 3e-3  # learning rate at the end of warm-up
    warmup_steps: int = 100  # linear warm-up from 0 to peak_lr
    min_lr_ratio: float = 0.1  # the cosine decays to peak_lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1  # AdamW decoupled decay on matrices (not norms)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping threshold
    init_std: float = 0.02  # std of the random init of every weight matrix
    seed: int = 0  # seeds the init and, with the step, every batch
    log_every: int = 10  # steps between host reads of the training loss
    eval_every: int = 200  # steps between validation losses
    val_tokens: int = 16_384  # budget of the fixed validation subset (first tokens of the split)
    eval_batch_size: int = 16  # windows per validation forward
    checkpoint_every: int = 200  # steps between orbax checkpoints
    keep_checkpoints: int = 2  # orbax keeps this many most recent checkpoints
    kd_weight: float = 1.0  # with a teacher: loss = kd_weight * KL + (1 - kd_weight) * CE

    def __post_init__(self):
        for name in (
            "seq_len",
            "batch_size",
            "steps",
            "log_every",
            "eval_every",
            "val_tokens",
            "eval_batch_size",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name}={value!r} must be a positive int")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"TrainConfig.warmup_steps={self.warmup_steps!r} must be an int in [0, steps="
                f"{self.steps})"
            )
        if not self.peak_lr > 0:
            raise ValueError(f"TrainConfig.peak_lr={self.peak_lr!r} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"TrainConfig.kd_weight={self.kd_weight!r} must be in [0, 1]")
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"TrainConfig.seq_len={self.seq_len} exceeds the model's max_position_embeddings="
                f"{self.model.max_position_embeddings}"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """The resolved config as a JSON object (`from_json` inverts it)."""
        return {**dataclasses.asdict(self), "model": self.model.to_dict()}

    @classmethod
    def from_json(cls, obj: dict) -> TrainConfig:
        obj = dict(obj)
        return cls(model=ModelConfig.from_dict(obj.pop("model")), **obj)


# ---------------------------------------------------------------------------------------------
# Schedule, optimizer, state
# ---------------------------------------------------------------------------------------------


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `peak_lr` over `warmup_steps`, then cosine to the floor.

    lr(s) = peak * s / W                                     for s < W
    lr(s) = peak * (r + (1 - r) * (1 + cos(pi * t)) / 2),    t = (s - W) / (steps - W), s >= W

    where r = `min_lr_ratio`; t is clipped to 1 past the end.
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.peak_lr,
        warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps,  # optax counts the warm-up inside decay_steps
        end_value=tc.peak_lr * tc.min_lr_ratio,
    )


def _decay_mask(params: dict) -> dict:
    """Weight decay on weight matrices only: norm gains are not pulled toward zero."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warm-up / cosine schedule."""
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(
            learning_rate=lr_schedule(tc),
            b1=tc.b1,
            b2=tc.b2,
            eps=tc.eps,
            weight_decay=tc.weight_decay,
            mask=_decay_mask,
        ),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a checkpoint holds; with the seed it determines the rest of the run."""

    step: jax.Array  # [] int32, optimizer steps taken; the next batch is batch_for_step(step)
    params: dict  # the params pytree (see jaxinfer.model.params)
    opt_state: Any  # optax state of `make_optimizer(tc)`, same tree structure every run


def init_state(tc: TrainConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state: params from `init_params(model, key(seed))`, zero moments, step 0."""
    params = init_params(tc.model, jax.random.key(tc.seed), std=tc.init_std)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def batch_for_step(stream: np.ndarray, tc: TrainConfig, step: int) -> np.ndarray:
    """The windows of optimizer step `step`: a pure function of (seed, step).

    Args:
      stream: [N] int training token stream.
      tc: the run config (seed, batch_size, seq_len).
      step: the 0-based step index.

    Returns:
      [batch_size, seq_len + 1] int32; inputs are `[:, :-1]`, targets `[:, 1:]`.
    """
    rng = np.random.default_rng([tc.seed, int(step)])
    return random_windows(stream, tc.batch_size, tc.seq_len, rng)


# ---------------------------------------------------------------------------------------------
# Jitted step and evaluation
# ---------------------------------------------------------------------------------------------

StepFn = Callable[..., tuple[TrainState, dict]]


@functools.lru_cache(maxsize=8)
def make_train_step(tc: TrainConfig, teacher_cfg: ModelConfig | None = None) -> StepFn:
    """The jitted step `(state, windows [B, S+1], teacher_params) -> (state, metrics)`.

    The state is donated: its buffers are reused for the new state, so never read a state after
    passing it in. Metrics are device scalars ("loss": the optimized loss, "ce": cross entropy,
    "kl": the distillation KL or 0, "grad_norm", "lr"); reading them forces a sync, so the loop
    reads them only every `log_every` steps.

    Cached on its (hashable) arguments, so runs with equal configs share one compilation.

    Args:
      tc: the run config (its model is the trained model; the optimizer is `make_optimizer(tc)`).
      teacher_cfg: the teacher's config for distillation, None for plain LM training.

    Returns:
      The jitted step function; pass `teacher_params=None` without a teacher.
    """
    cfg = tc.model
    optimizer = make_optimizer(tc)
    schedule = lr_schedule(tc)
    kd = tc.kd_weight if teacher_cfg is not None else 0.0
    backend = resolve_backend("auto")  # once, here: nothing traced reads the platform

    def loss_fn(params, inputs, targets, teacher_logits):
        logits = forward_dense(params, cfg, inputs, backend=backend)  # [B, S, V] float32
        ce = lm_loss(logits, targets)
        if teacher_logits is None:
            return ce, (ce, jnp.zeros((), jnp.float32))
        kl = distill_kl(logits, teacher_logits)
        return kd * kl + (1.0 - kd) * ce, (ce, kl)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state: TrainState, windows: jax.Array, teacher_params=None):
        inputs, targets = windows[:, :-1], windows[:, 1:]  # [B, S] each
        teacher_logits = None
        if teacher_cfg is not None:
            teacher_logits = forward_dense(teacher_params, teacher_cfg, inputs, backend=backend)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (ce, kl)), grads = grad_fn(state.params, inputs, targets, teacher_logits)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "ce": ce,
            "kl": kl,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


@functools.lru_cache(maxsize=8)
def make_eval_fn(cfg: ModelConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """Jitted `(params, windows [B, S+1]) -> [B]`: each window's summed token cross entropy."""
    backend = resolve_backend("auto")  # once, here: nothing traced reads the platform

    @jax.jit
    def eval_fn(params, windows):
        logits = forward_dense(params, cfg, windows[:, :-1], backend=backend)  # [B, S, V]
        return jnp.sum(token_cross_entropy(logits, windows[:, 1:]), axis=-1)  # [B]

    return eval_fn


def mean_loss(
    eval_fn: Callable[[dict, jax.Array], jax.Array],
    params: dict,
    windows: np.ndarray,
    batch_size: int,
) -> float:
    """Mean token cross entropy (nats) over fixed windows `[W, S+1]`, `batch_size` at a time.

    The last batch is padded with copies of its last window and the copies are dropped, so every
    call has one shape (one compilation).
    """
    windows = np.asarray(windows)
    total, n = 0.0, windows.shape[0]
    for start in range(0, n, batch_size):
        chunk = windows[start : start + batch_size]  # [<=B, S+1]
        real = chunk.shape[0]
        if real < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
        total += float(np.sum(np.asarray(eval_fn(params, chunk), np.float64)[:real]))
    return total / (n * (windows.shape[1] - 1))


# ---------------------------------------------------------------------------------------------
# Checkpoints and the loop
# ---------------------------------------------------------------------------------------------


def checkpoint_manager(workdir: str | os.PathLike, tc: TrainConfig):
    """An orbax CheckpointManager over `<workdir>/checkpoints`, keeping the last few steps."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True)
    path = Path(workdir).resolve() / "checkpoints"
    return ocp.CheckpointManager(path, options=options)


def restore_or_init(manager, tc: TrainConfig, optimizer) -> TrainState:
    """The latest checkpointed state in `manager`, or a fresh one when there is none."""
    import orbax.checkpoint as ocp

    fresh = init_state(tc, optimizer)
    latest = manager.latest_step()
    if latest is None:
        return fresh
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh)
    return manager.restore(latest, args=ocp.args.StandardRestore(abstract))


def _save(manager, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state.step), args=ocp.args.StandardSave(state))


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the final state and the logged curve."""

    state: TrainState
    curve: list[dict]  # one record per log/eval event: {"step", "loss", ..., "val_loss"?}
    tokens_per_s: float  # training tokens/s after the first log (compilation), validation excluded
    wall_s: float  # wall time of this call


def _read_curve(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= upto]


def train(
    tc: TrainConfig,
    stream: np.ndarray,
    workdir: str | os.PathLike,
    *,
    val_windows: np.ndarray | None = None,
    teacher: tuple[ModelConfig, dict] | None = None,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Trains (or resumes training) and checkpoints into `workdir`.

    Resumes from the latest orbax checkpoint in `<workdir>/checkpoints` if there is one; the loss
    curve `<workdir>/loss_curve.jsonl` is truncated to the restored step and continued, so an
    interrupted and resumed run writes the same curve as an uninterrupted one. A checkpoint is
    written every `checkpoint_every` steps and at the last step.

    Args:
      tc: the run config.
      stream: [N] int training token stream.
      workdir: run folder (checkpoints, loss_curve.jsonl).
      val_windows: [W, seq_len + 1] fixed validation windows, evaluated every `eval_every` steps
        and at the end; None skips validation.
      teacher: (config, params) of the distillation teacher, None for plain LM training.
      stop_after: stop (after checkpointing) once this many steps are done in total, to simulate an
        interruption; None runs to `tc.steps`.
      progress: show a tqdm progress bar.

    Returns:
      The TrainResult.
    """
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if teacher is not None and teacher[0].vocab_size != tc.model.vocab_size:
        raise ValueError(
            f"teacher vocab_size={teacher[0].vocab_size} differs from the student's "
            f"{tc.model.vocab_size}"
        )
    end = tc.steps if stop_after is None else min(int(stop_after), tc.steps)
    optimizer = make_optimizer(tc)
    manager = checkpoint_manager(workdir, tc)
    state = restore_or_init(manager, tc, optimizer)
    start = int(state.step)
    curve_path = workdir / "loss_curve.jsonl"
    curve = _read_curve(curve_path, start)
    curve_path.write_text("".join(json.dumps(r) + "\n" for r in curve))

    step_fn = make_train_step(tc, None if teacher is None else teacher[0])
    teacher_params = None if teacher is None else teacher[1]
    eval_fn = make_eval_fn(tc.model)
    tokens_per_step = tc.batch_size * tc.seq_len
    last_metrics: dict | None = None  # device scalars of the latest step, read every log_every
    timed_from: tuple[int, float] | None = None  # (step, time) after the first sync
    eval_s = 0.0  # validation time since timed_from, left out of tokens/s
    bar = tqdm(total=end, initial=start, disable=not progress, desc=tc.name, unit="step")

    def flush(step: int, val: float | None) -> None:
        nonlocal timed_from, eval_s
        host = jax.device_get(last_metrics)  # the one sync per log interval
        now = time.perf_counter()
        if timed_from is None:
            timed_from, eval_s = (step, now), 0.0  # everything before includes compilation
        # The last step's metrics, not a window mean: a resumed run restarts mid-window, and
        # its curve must still equal the uninterrupted one.
        rec = {"step": step, **{k: float(v) for k, v in host.items()}}
        if val is not None:
            rec["val_loss"] = val
        if step > timed_from[0]:
            busy = now - timed_from[1] - eval_s
            rec["tokens_per_s"] = (step - timed_from[0]) * tokens_per_step / busy
        with curve_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        curve.append(rec)
        bar.set_postfix(
            loss=f"{rec.get('loss', float('nan')):.3f}",
            **({"val": f"{val:.3f}"} if val is not None else {}),
        )

    for step in range(start, end):
        windows = jnp.asarray(batch_for_step(stream, tc, step))
        state, last_metrics = step_fn(state, windows, teacher_params)
        done = step + 1
        bar.update(1)
        is_eval = val_windows is not None and (done % tc.eval_every == 0 or done == tc.steps)
        if done % tc.log_every == 0 or is_eval or done == end:
            val = None
            if is_eval:
                t_eval = time.perf_counter()
                val = mean_loss(eval_fn, state.params, val_windows, tc.eval_batch_size)
                eval_s += time.perf_counter() - t_eval
            flush(done, val)
        if done % tc.checkpoint_every == 0 or done == end:
            _save(manager, state)
    manager.wait_until_finished()
    manager.close()
    bar.close()
    tps = float("nan")
    if timed_from is not None and end > timed_from[0]:
        busy = time.perf_counter() - timed_from[1] - eval_s
        tps = (end - timed_from[0]) * tokens_per_step / busy
    return TrainResult(
        state=state, curve=curve, tokens_per_s=tps, wall_s=time.perf_counter() - t_start
    )


def plot_curve(curve: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Writes the training (and validation) loss curve as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train_pts = [(r["step"], r["loss"]) for r in curve if "loss" in r]
    ce_pts = [(r["step"], r["ce"]) for r in curve if "ce" in r]
    val_pts = [(r["step"], r["val_loss"]) for r in curve if "val_loss" in r]
    distilled = any(r.get("kl", 0.0) > 0 for r in curve)
    if train_pts:
        ax.plot(*zip(*train_pts), label="train loss (KL mix)" if distilled else "train loss", lw=1)
    if distilled and ce_pts:
        ax.plot(*zip(*ce_pts), label="train CE", lw=1, alpha=0.7)
    if val_pts:
        ax.plot(*zip(*val_pts), "o-", label="validation loss (CE)", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
