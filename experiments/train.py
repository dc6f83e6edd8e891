r"""Trains an embedded model (target, draft, or the tiny test config) and exports it as an HF dir.

Random windows of the train split's token stream, AdamW with warm-up and cosine decay, periodic
validation on a fixed subset of the validation split, orbax checkpoints that resume exactly. The
draft can be distilled from a trained target (`--teacher`) or trained as a plain LM.

    python -m experiments.train --config=target --workdir=/tmp/jaxinfer_runs/target \
        --export_dir=jaxinfer/assets/models/target
    python -m experiments.train --config=draft --teacher=jaxinfer/assets/models/target \
        --workdir=/tmp/jaxinfer_runs/draft --export_dir=jaxinfer/assets/models/draft
    python -m experiments.train --config=draft --teacher= --workdir=/tmp/jaxinfer_runs/draft_lm
    python -m experiments.train --config=tiny --workdir=/tmp/tiny --steps=20

Writes into --workdir: train_config.json (the resolved config), checkpoints/ (orbax),
loss_curve.jsonl, loss_curve.png, results.json. Re-running with the same --workdir resumes from
the latest checkpoint (the config must be unchanged).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
from absl import app, flags, logging

from experiments import common, flag_checks
from experiments.configs import NAMES, get_config
from jaxinfer import data
from jaxinfer import train as jtrain
from jaxinfer.checkpoint import load_checkpoint, save_checkpoint

_CONFIG = flags.DEFINE_string(
    "config",
    "target",
    f"Which experiments/configs setting ({', '.join(NAMES)}), or a saved <workdir>/config.json "
    "to rerun (its flags, with the flags given here on top).",
)
flags.register_validator(
    "config",
    lambda v: v in NAMES or str(v).endswith(".json"),
    f"--config must be one of {', '.join(NAMES)} or a path to a saved config.json",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder (checkpoints, curves, config).")
_EXPORT_DIR = flags.DEFINE_string("export_dir", "", "Write the final HF directory here.")
_TEACHER = flags.DEFINE_string("teacher", "", "HF dir of the distillation teacher; empty: LM loss.")
_STEPS = flags.DEFINE_integer("steps", None, "Override TrainConfig.steps.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Override TrainConfig.batch_size.", lower_bound=1
)
_PEAK_LR = flags.DEFINE_float("peak_lr", None, "Override TrainConfig.peak_lr.")
_WARMUP = flags.DEFINE_integer(
    "warmup_steps", None, "Override TrainConfig.warmup_steps.", lower_bound=0
)
_SEED = flags.DEFINE_integer("seed", None, "Override TrainConfig.seed.", lower_bound=0)
_KD_WEIGHT = flags.DEFINE_float("kd_weight", None, "Override TrainConfig.kd_weight.")
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", None, "Override TrainConfig.eval_every.", lower_bound=1
)
_CKPT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", None, "Override checkpoint_every.", lower_bound=1
)
_STOP_AFTER = flags.DEFINE_integer(
    "stop_after", None, "Stop after this many steps (no export).", lower_bound=1
)
flags.mark_flag_as_required("workdir")
flag_checks.number(_PEAK_LR, above=0.0)
flag_checks.number(_KD_WEIGHT, min_value=0.0, max_value=1.0)


def _resolved_config() -> jtrain.TrainConfig:
    tc = get_config(_CONFIG.value)
    overrides = {
        "steps": _STEPS.value,
        "batch_size": _BATCH_SIZE.value,
        "peak_lr": _PEAK_LR.value,
        "warmup_steps": _WARMUP.value,
        "seed": _SEED.value,
        "kd_weight": _KD_WEIGHT.value,
        "eval_every": _EVAL_EVERY.value,
        "checkpoint_every": _CKPT_EVERY.value,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in overrides and "warmup_steps" not in overrides:
        overrides["warmup_steps"] = min(tc.warmup_steps, max(overrides["steps"] // 10, 0))
    return tc.replace(**overrides)


def _write_config(workdir: Path, resolved: dict) -> None:
    path = workdir / "train_config.json"
    if path.is_file() and (workdir / "checkpoints").is_dir():
        previous = json.loads(path.read_text())
        if previous != resolved:
            raise ValueError(
                f"{path} holds a different config than this run's; resuming would mix two runs. "
                "Use a fresh --workdir or the same flags."
            )
    path.write_text(json.dumps(resolved, indent=2) + "\n")


def main(argv):
    del argv
    if _CONFIG.value not in NAMES:  # a saved run: its setting name and flags
        common.apply_config(_CONFIG.value, skip=("workdir",), take=("config",))
    tc = _resolved_config()
    workdir = Path(_WORKDIR.value)
    workdir.mkdir(parents=True, exist_ok=True)
    resolved = {"train": tc.to_json(), "teacher": _TEACHER.value or None}
    _write_config(workdir, resolved)
    common.save_config(str(workdir), resolved=resolved)

    tok = data.load_tokenizer()
    stream = data.token_stream("train", tok, cache_dir=workdir)  # [N]
    val_stream = data.token_stream("validation", tok, cache_dir=workdir)  # [Nv]
    val_windows = data.eval_windows(val_stream, tc.seq_len, tc.val_tokens)  # [W, S+1]
    logging.info(
        "%s: %.2f M params, train stream %d tokens, %d validation windows",
        tc.name,
        tc.model.num_params() / 1e6,
        stream.shape[0],
        val_windows.shape[0],
    )
    teacher = None
    if _TEACHER.value:
        teacher = load_checkpoint(_TEACHER.value, dtype=jnp.float32)
        logging.info("distilling from %s (kd_weight=%s)", _TEACHER.value, tc.kd_weight)

    result = jtrain.train(
        tc, stream, workdir, val_windows=val_windows, teacher=teacher, stop_after=_STOP_AFTER.value
    )
    jtrain.plot_curve(result.curve, workdir / "loss_curve.png", title=f"{tc.name} training")
    last = result.curve[-1] if result.curve else {}
    vals = [r for r in result.curve if "val_loss" in r]
    summary = {
        "config": tc.name,
        "teacher": _TEACHER.value or None,
        "num_params": tc.model.num_params(),
        "steps_done": int(result.state.step),
        "steps": tc.steps,
        "tokens_seen": int(result.state.step) * tc.batch_size * tc.seq_len,
        "final_train_loss": last.get("loss"),
        "final_train_ce": last.get("ce"),
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "tokens_per_s_this_session": result.tokens_per_s,
        "wall_s_this_session": result.wall_s,
    }
    common.write_results(str(workdir), summary)
    print(json.dumps(summary, indent=2))

    if _EXPORT_DIR.value and int(result.state.step) == tc.steps:
        out = Path(_EXPORT_DIR.value)
        generation = {"pad_token_id": data.PAD_ID, "do_sample": False}
        # A deliberate re-export replaces the previous one (and keeps the other files there).
        save_checkpoint(str(out), tc.model, result.state.params, tok, generation, overwrite=True)
        for name in ("train_config.json", "loss_curve.jsonl", "loss_curve.png", "results.json"):
            shutil.copyfile(workdir / name, out / name)
        print(f"exported {tc.name} to {out}")


if __name__ == "__main__":
    app.run(main)
