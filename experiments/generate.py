r"""Generates a completion of one prompt with a Hugging Face checkpoint directory.

    python -m experiments.generate --model=/path/to/hf_dir --prompt="def fib(n):" --max_tokens=64
    python -m experiments.generate --prompt="import os" --temperature=0.8 --top_p=0.95
    python -m experiments.generate --model=smollm2-135m --repetition_penalty=1.2
    python -m experiments.generate --model=smollm2-135m --min_tokens=48
    python -m experiments.generate --model=smollm2-135m --bad_words_ids="198;260,260"

(SmolLM2's 198 is a newline, 260 " the": no newline, no " the the".) Without --model it uses
the shipped target model (jaxinfer.models.path("target")).
Prints the text, the token ids, tokens/s and the achieved weight bandwidth (GB/s: the weights
are read once a decode step), timed on a second, already compiled call. With --workdir it
writes config.json and results.json there (rerun with --config=<workdir>/config.json).
"""

from __future__ import annotations

import time

from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import memory

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint dir; default: the shipped target.")
_PROMPT = flags.DEFINE_string("prompt", "def fib(n):", "Prompt text.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off.", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off.")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
_REPETITION = flags.DEFINE_float("repetition_penalty", 1.0, "1 = off; in [0.01, 100].")
_FREQUENCY = flags.DEFINE_float("frequency_penalty", 0.0, "0 = off; in [-2, 2].")
_PRESENCE = flags.DEFINE_float("presence_penalty", 0.0, "0 = off; in [-2, 2].")
_MIN_TOKENS = flags.DEFINE_integer(
    "min_tokens", 0, "No eos or stop token before this many tokens; 0 = off.", lower_bound=0
)
_BAD_WORDS = flags.DEFINE_string(
    "bad_words_ids", "", "Banned token-id sequences, ';' between them and ',' inside: '7;3,5' "
    "bans 7, and 5 after 3, in the output (vLLM's bad_words rule); empty = off.",
)  # fmt: skip
_BACKEND = flags.DEFINE_enum("backend", "auto", ji.ops.BACKENDS, "Attention backend.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Optional: write config.json, results.json here.")
_CONFIG = common.config_flag()
flag_checks.number(_TEMPERATURE, min_value=0.0)
flag_checks.number(_TOP_P, above=0.0, max_value=1.0)
flag_checks.number(_MIN_P, min_value=0.0, max_value=1.0)
flag_checks.number(_REPETITION, min_value=0.01, max_value=100.0)
flag_checks.number(_FREQUENCY, min_value=-2.0, max_value=2.0)
flag_checks.number(_PRESENCE, min_value=-2.0, max_value=2.0)


def _bans(text: str) -> list[tuple[int, ...]]:
    """`--bad_words_ids` as id sequences; raises ValueError naming the bad part."""
    bans = []
    for part in filter(None, text.split(";")):
        try:
            bans.append(tuple(int(t) for t in part.split(",")))
        except ValueError:
            raise ValueError(f"{part!r} is not a ','-separated list of token ids") from None
    ji.SamplingParams(bad_words_ids=bans)  # its own checks: ids >= 0, counts, lengths
    return bans


def _check_bans(text: str) -> bool:
    try:
        _bans(text)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


flags.register_validator("bad_words_ids", _check_bans)
flags.register_multi_flags_validator(
    ["min_tokens", "max_tokens"], lambda f: f["min_tokens"] <= f["max_tokens"],
    message="--min_tokens must be <= --max_tokens",
)  # fmt: skip


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    path = common.resolve_model(_MODEL.value or "target")
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value, resolved={"model": path})
    cfg, params = ji.load_checkpoint(path)
    tok = ji.load_tokenizer(path)
    ids = tok.encode(_PROMPT.value).ids
    if cfg.bos_token_id is not None:
        ids = [cfg.bos_token_id] + ids
    sp = ji.SamplingParams(
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
        min_p=_MIN_P.value, max_tokens=_MAX_TOKENS.value, seed=_SEED.value,
        repetition_penalty=_REPETITION.value, frequency_penalty=_FREQUENCY.value,
        presence_penalty=_PRESENCE.value, min_tokens=_MIN_TOKENS.value,
        bad_words_ids=_bans(_BAD_WORDS.value),
    )  # fmt: skip
    t0 = time.perf_counter()
    out = ji.generate(cfg, params, [ids], sp, backend=_BACKEND.value)[0]
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    ji.generate(cfg, params, [ids], sp, backend=_BACKEND.value)
    steady = time.perf_counter() - t0
    n = len(out.token_ids)
    nbytes = memory.tree_bytes(params)
    res = {
        "model": path, "prompt": _PROMPT.value, "text": tok.decode(out.token_ids),
        "token_ids": out.token_ids, "finish_reason": out.finish_reason, "tokens": n,
        "first_call_s": first, "steady_s": steady, "tok_s": n / steady,
        "weight_bytes": nbytes, "weight_gb_s": common.gb_per_s(nbytes, n, steady),
        "load_average": common.load_average(),
    }  # fmt: skip
    print(_PROMPT.value + res["text"])
    print(f"\ntoken ids: {out.token_ids}")
    print(
        f"{n} tokens, finish_reason={out.finish_reason}; first call (with compile) {first:.2f}s; "
        f"compiled: {res['tok_s']:.1f} tokens/s, {res['weight_gb_s']:.2f} GB/s of weights "
        f"({nbytes / 1e6:.1f} MB read once a step)"
    )
    if _WORKDIR.value:
        common.write_results(_WORKDIR.value, res)


if __name__ == "__main__":
    app.run(main)
