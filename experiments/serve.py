r"""Serves a model over the OpenAI HTTP API (jaxinfer.server) until SIGTERM or Ctrl-C.

    python -m experiments.serve --model=target --port=8000
    python -m experiments.serve --model=/path/to/hf_dir --chat_template=template.jinja \
        --num_blocks=2048 --max_num_seqs=32 --max_waiting=128 --request_log=requests.jsonl
    python -m experiments.serve --model=smollm2-135m --speculative=ngram \
        --num_speculative_tokens=auto --max_gamma=4 --cycle_log=cycles.jsonl
    python -m experiments.serve --model=smollm2-135m --speculative=head \
        --draft_head=smollm2-135m-eagle --num_speculative_tokens=3
    python -m experiments.serve --model=smollm2-135m --speculative=head \
        --draft_head=smollm2-135m-eagle --ngram_first=2 --num_speculative_tokens=auto

--model is a shipped model name (jaxinfer.models.names()) or an HF checkpoint directory.
Compiled programs are kept in --compilation_cache (on by default), so a second start loads
them instead of compiling (`ji.enable_compilation_cache`). --port=0 picks a free port. Once the
server accepts connections it prints one line `serving MODEL at http://HOST:PORT` (scripts wait
for it). SIGTERM stops admitting, gives in-flight requests --shutdown_timeout seconds, aborts the
rest, and exits 0.

--speculative=ngram (prompt lookup), =model (with --draft_model) or =head (a learned Medusa or
EAGLE-style head trained for the model, with --draft_head: a shipped head's name, e.g.
smollm2-135m-eagle, or a head folder; --ngram_first=2 makes it the hybrid that takes the
n-gram's proposal where two or more tokens of suffix recur) serves with speculative decoding
(`ji.SpeculativeConfig`): γ = --num_speculative_tokens drafted tokens per request and step,
or `auto` (the engine's controller picks γ in 0..--max_gamma every step; --warmup then also
measures its step-time table). /metrics then has the acceptance counters (drafts, draft and
accepted tokens, per position) and the γ of each step; --cycle_log writes the engine's JSONL
record of every request's every speculative step (jaxinfer/engine/cycles.py). --request_log
writes one JSON line per finished request (arrival, first token, finish, tokens, finish reason).
Requests with logprobs get a 400 while speculation is on (the engine does not return them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time

from absl import app, flags, logging

import jaxinfer as ji
from jaxinfer.cache.metadata import bucket
from jaxinfer.engine import cycles
from jaxinfer.engine.config import TOKEN_BUCKETS
from jaxinfer.server.detokenizer import decode

_MODEL = flags.DEFINE_string("model", "target", "Shipped model name or HF checkpoint dir.")
_SERVED_NAME = flags.DEFINE_string("served_model_name", None, "API model id; default --model.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port; 0: a free one.", lower_bound=0, upper_bound=65535)
_CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template", None, "A jinja chat template (a file, or the template itself)."
)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "KV block size.", lower_bound=1)
_NUM_BLOCKS = flags.DEFINE_integer(
    "num_blocks", 1025, "KV blocks (null block included).", lower_bound=2
)
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Sequences per step.", lower_bound=1)
_MAX_BATCHED = flags.DEFINE_integer(
    "max_num_batched_tokens", 256, "Token budget per step.", lower_bound=1
)
_PREFIX_CACHING = flags.DEFINE_boolean("enable_prefix_caching", True, "Prefix caching.")
_BACKEND = flags.DEFINE_enum(
    "backend", "auto", ["auto", "xla", "reference", "pallas", "pallas-interpret"], "Attention."
)
_MAX_WAITING = flags.DEFINE_integer(
    "max_waiting", 256, "Requests without a first token; more get 503.", lower_bound=1
)
_REQUEST_LOG = flags.DEFINE_string("request_log", None, "JSONL request log; default off.")
_SHUTDOWN_TIMEOUT = flags.DEFINE_float(
    "shutdown_timeout", 30.0, "Seconds in-flight requests get after SIGTERM.", lower_bound=0
)
_MAX_MODEL_LEN = flags.DEFINE_integer(
    "max_model_len", None, "Longest prompt + completion; default the model's.", lower_bound=2
)
_MIN_TOKEN_BUCKET = flags.DEFINE_integer(
    "min_token_bucket", ji.EngineConfig.min_token_bucket, "Smallest padded T.", lower_bound=1
)
_TOKEN_BUCKETS = flags.DEFINE_string(
    "token_buckets", "measured",
    "T buckets up to 16: 'measured', 'pow2', or powers of two, e.g. 1,2,4,16 (another "
    "engine's, so two engines step alike).",
)  # fmt: skip
_WARMUP = flags.DEFINE_boolean("warmup", True, "Compile every step shape before serving.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "default", "Folder that keeps compiled programs across starts "
    "(ji.enable_compilation_cache): 'default' is $JAXINFER_CACHE_DIR/xla or "
    "~/.cache/jaxinfer/xla; '' turns it off.",
)  # fmt: skip
_COMPILATION_CACHE_MB = flags.DEFINE_integer(
    "compilation_cache_mb", 1024, "Bound on --compilation_cache: past it the least recently "
    "used programs are deleted (a server's take ~10 MB); 0 for no bound.", lower_bound=0,
)  # fmt: skip
_SPECULATIVE = flags.DEFINE_enum(
    "speculative", "none", ["none", "ngram", "model", "head"], "Speculative decoding's drafter."
)
_DRAFT_MODEL = flags.DEFINE_string(
    "draft_model", None, "--speculative=model: the draft's name or checkpoint dir."
)
_DRAFT_HEAD = flags.DEFINE_string(
    "draft_head", None, "--speculative=head: a shipped head's name or a head folder."
)
_NGRAM_FIRST = flags.DEFINE_integer(
    "ngram_first", 0, "--speculative=head: rows whose last N+ tokens recur take the n-gram's "
    "proposal (the hybrid drafter, `Head.ngram_first`); 0: the head drafts every row.",
    lower_bound=0, upper_bound=3,
)  # fmt: skip
_NUM_SPEC = flags.DEFINE_string(
    "num_speculative_tokens", "3", "γ: an int in 0..max_gamma, or 'auto' (the controller)."
)
_MAX_GAMMA = flags.DEFINE_integer(
    "max_gamma", None, "Largest γ; default: the int γ, or 4 with auto.", lower_bound=1
)
_ACCEPTANCE = flags.DEFINE_enum(
    "spec_acceptance", "rejection", ["rejection", "coupled"], "Speculative acceptance rule."
)
_CYCLE_LOG = flags.DEFINE_string(
    "cycle_log", None, "JSONL log of every speculative step per request; default off."
)
_LOG_LEVEL = flags.DEFINE_enum(
    "uvicorn_log_level", "warning", ["debug", "info", "warning", "error"], "uvicorn's log level."
)


def _model_is_valid(value: str) -> bool:
    return value in ji.models.names() or os.path.isdir(value) or os.path.isfile(value)


flags.register_validator(
    "model", _model_is_valid, "--model must be a shipped model name or an existing path"
)
flags.register_validator(
    "compilation_cache", lambda v: v in ("", "default") or not os.path.isfile(v),
    "--compilation_cache must be a folder (new or existing), 'default' or ''",
)  # fmt: skip


def token_buckets(value: str) -> str | tuple[int, ...]:
    """--token_buckets as EngineConfig.token_buckets: a policy name or a tuple of ints."""
    if value in TOKEN_BUCKETS:
        return value
    try:
        return tuple(int(b) for b in value.split(","))
    except ValueError:
        msg = f"--token_buckets={value!r}: expected 'measured', 'pow2' or ints"
        raise ValueError(msg) from None


def _token_buckets_are_valid(value: str) -> bool:
    try:
        ji.EngineConfig(token_buckets=token_buckets(value))
    except ValueError:
        return False
    return True


flags.register_validator(
    "token_buckets", _token_buckets_are_valid,
    "--token_buckets must be 'measured', 'pow2' or increasing powers of two, e.g. 1,2,4,16",
)  # fmt: skip


def _num_spec_is_valid(value: str) -> bool:
    return value == "auto" or (value.isdigit() and int(value) >= 0)


flags.register_validator(
    "num_speculative_tokens", _num_spec_is_valid,
    "--num_speculative_tokens must be an int >= 0 or 'auto'",
)  # fmt: skip
flags.register_validator(
    "draft_model", lambda v: v is None or _model_is_valid(v),
    "--draft_model must be a shipped model name or an existing path",
)  # fmt: skip
flags.register_validator(
    "draft_head", lambda v: v is None or v in ji.models.asset_names("head") or os.path.isdir(v),
    "--draft_head must be a shipped head's name (ji.models.asset_names('head')) or a folder",
)  # fmt: skip
flags.register_multi_flags_validator(
    ["speculative", "draft_model", "draft_head", "cycle_log"],
    lambda f: (f["speculative"] == "model") == (f["draft_model"] is not None)
    and (f["speculative"] == "head") == (f["draft_head"] is not None)
    and (f["cycle_log"] is None or f["speculative"] != "none"),
    "--draft_model goes with --speculative=model and --draft_head with --speculative=head (and "
    "only with them); --cycle_log needs --speculative",
)  # fmt: skip

flags.register_multi_flags_validator(
    ["speculative", "ngram_first"],
    lambda f: f["ngram_first"] == 0 or f["speculative"] == "head",
    "--ngram_first goes with --speculative=head (the hybrid of a head and the n-gram)",
)  # fmt: skip
flags.register_multi_flags_validator(
    ["num_speculative_tokens", "max_gamma"],
    lambda f: f["max_gamma"] is None
    or not _num_spec_is_valid(f["num_speculative_tokens"])
    or f["num_speculative_tokens"] == "auto"
    or int(f["num_speculative_tokens"]) <= f["max_gamma"],
    "--num_speculative_tokens must be <= --max_gamma",
)  # fmt: skip


def speculative_config(
    drafter: str,
    num_speculative_tokens: str,
    max_gamma: int | None = None,
    acceptance: str = "rejection",
    draft_model: str | None = None,
    draft_head: str | None = None,
    target: ji.ModelConfig | None = None,
    ngram_first: int = 0,
) -> ji.SpeculativeConfig | None:
    """The flags' SpeculativeConfig; None for drafter "none". A head is checked against
    `target` when given (ValueError naming the field of another target); `ngram_first` makes it
    the hybrid drafter."""
    if drafter == "none":
        return None
    if drafter == "model":
        drafter = ji.load_checkpoint(model_path(draft_model))
    elif drafter == "head":
        head = ji.speculative.heads.load_head(model_path(draft_head), target)
        drafter = dataclasses.replace(head, ngram_first=ngram_first)
    n = num_speculative_tokens
    return ji.SpeculativeConfig(
        drafter=drafter, num_speculative_tokens=n if n == "auto" else int(n),
        acceptance=acceptance, max_gamma=max_gamma,
    )  # fmt: skip


def model_path(name: str) -> str:
    return ji.models.path(name) if name in ji.models.names() else name


def engine_config(
    cfg: ji.ModelConfig,
    block_size: int = 16,
    num_blocks: int = 1025,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    enable_prefix_caching: bool = True,
    backend: str = "auto",
    max_model_len: int | None = None,
    min_token_bucket: int = ji.EngineConfig.min_token_bucket,
    speculative: ji.SpeculativeConfig | None = None,
    cycle_log: str | None = None,
    token_buckets: str | tuple[int, ...] = "measured",
) -> ji.EngineConfig:
    """The served engine's config (bench_serve.py builds the in-process twin with it)."""
    S = block_size
    max_len = min(max_model_len or cfg.max_position_embeddings, (num_blocks - 1) * S)
    return ji.EngineConfig(
        block_size=S,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        backend=backend,
        # B and M fixed: one compilation per token bucket T, all of them made by --warmup.
        min_seq_bucket=max_num_seqs,
        min_block_bucket=bucket(math.ceil(max_len / S)),
        min_token_bucket=min_token_bucket,
        token_buckets=token_buckets,
        speculative=speculative,
        cycle_log=cycle_log,
    )


def warmup(engine: ji.Engine, max_len: int | None = None) -> None:
    """One prompt per token bucket T the engine can use (greedy, 2 tokens), so serving compiles
    nothing; each prompt has its own token so the prefix cache cannot shorten it."""
    t, token = engine.config.min_token_bucket, 3
    top = bucket(engine.config.max_num_batched_tokens)
    while t <= top:
        length = min(t, engine.config.max_num_batched_tokens - 1)
        length = max(1, min(length, (max_len or engine.cfg.max_position_embeddings) - 2))
        engine.generate([[token] * length], ji.SamplingParams(temperature=0, max_tokens=2))
        t, token = 2 * t, token + 1
    spec = engine.config.speculative
    if spec is not None and spec.auto:  # the controller's step times at every batch bucket
        sizes = [1 << k for k in range(bucket(engine.config.max_num_seqs).bit_length())]
        cycles.warm_up(engine, batch_sizes=[b for b in sizes if b <= engine.config.max_num_seqs])


def main(argv):
    del argv
    if _COMPILATION_CACHE.value:
        where = None if _COMPILATION_CACHE.value == "default" else _COMPILATION_CACHE.value
        bound = _COMPILATION_CACHE_MB.value << 20 or None
        logging.info(
            "compilation cache: %s", ji.enable_compilation_cache(where, max_size_bytes=bound)
        )
    path = model_path(_MODEL.value)
    name = _SERVED_NAME.value or _MODEL.value
    template = _CHAT_TEMPLATE.value
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    cfg, params = ji.load_checkpoint(path)
    tok = ji.load_tokenizer(path)
    spec = speculative_config(
        _SPECULATIVE.value, _NUM_SPEC.value, _MAX_GAMMA.value, _ACCEPTANCE.value,
        _DRAFT_MODEL.value, _DRAFT_HEAD.value, cfg, _NGRAM_FIRST.value,
    )  # fmt: skip
    ecfg = engine_config(
        cfg, _BLOCK_SIZE.value, _NUM_BLOCKS.value, _MAX_NUM_SEQS.value, _MAX_BATCHED.value,
        _PREFIX_CACHING.value, _BACKEND.value, _MAX_MODEL_LEN.value, _MIN_TOKEN_BUCKET.value,
        spec, _CYCLE_LOG.value, token_buckets(_TOKEN_BUCKETS.value),
    )  # fmt: skip
    engine = ji.Engine(cfg, params, ecfg, detokenize=lambda ids: decode(tok, ids))
    if _WARMUP.value:
        t0 = time.perf_counter()
        warmup(engine, _MAX_MODEL_LEN.value)
        logging.info("warmup: %.1f s", time.perf_counter() - t0)
    server = ji.server.Server(
        engine,
        tok,
        _HOST.value,
        _PORT.value,
        model_name=name,
        chat_template=template,
        max_model_len=_MAX_MODEL_LEN.value,
        max_waiting=_MAX_WAITING.value,
        request_log=_REQUEST_LOG.value,
        shutdown_timeout=_SHUTDOWN_TIMEOUT.value,
        log_level=_LOG_LEVEL.value,
    )

    def announce():
        while not server.started:
            time.sleep(0.02)
        print(f"serving {name} at {server.url}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    print("server stopped", flush=True)


if __name__ == "__main__":
    app.run(main)
