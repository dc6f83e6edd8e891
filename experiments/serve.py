r"""Serves a model over the OpenAI HTTP API (jaxinfer.server) until SIGTERM or Ctrl-C.

    python experiments/serve.py --model=target --port=8000
    python experiments/serve.py --model=/path/to/hf_dir --chat_template=template.jinja \
        --num_blocks=2048 --max_num_seqs=32 --max_waiting=128 --request_log=requests.jsonl

--model is a shipped model name (jaxinfer.models.names()) or an HF checkpoint directory.
--port=0 picks a free port. Once the server accepts connections it prints one line
`serving MODEL at http://HOST:PORT` (scripts wait for it). SIGTERM stops admitting, gives
in-flight requests --shutdown_timeout seconds, aborts the rest, and exits 0.
"""

from __future__ import annotations

import math
import os
import threading
import time

from absl import app, flags, logging

import jaxinfer as ji
from jaxinfer.cache.metadata import bucket

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
_WARMUP = flags.DEFINE_boolean("warmup", True, "Compile every step shape before serving.")
_LOG_LEVEL = flags.DEFINE_enum(
    "uvicorn_log_level", "warning", ["debug", "info", "warning", "error"], "uvicorn's log level."
)


def _model_is_valid(value: str) -> bool:
    return value in ji.models.names() or os.path.isdir(value) or os.path.isfile(value)


flags.register_validator(
    "model", _model_is_valid, "--model must be a shipped model name or an existing path"
)


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


def main(argv):
    del argv
    path = model_path(_MODEL.value)
    name = _SERVED_NAME.value or _MODEL.value
    template = _CHAT_TEMPLATE.value
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    cfg, params = ji.load_checkpoint(path)
    tok = ji.load_tokenizer(path)
    ecfg = engine_config(
        cfg, _BLOCK_SIZE.value, _NUM_BLOCKS.value, _MAX_NUM_SEQS.value, _MAX_BATCHED.value,
        _PREFIX_CACHING.value, _BACKEND.value, _MAX_MODEL_LEN.value, _MIN_TOKEN_BUCKET.value,
    )  # fmt: skip
    engine = ji.Engine(cfg, params, ecfg)
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
