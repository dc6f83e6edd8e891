"""An OpenAI-compatible HTTP server over one `ji.Engine`.

    import jaxinfer as ji
    engine = ji.Engine(cfg, params, ji.EngineConfig(...))
    ji.server.serve(engine, tok, host="127.0.0.1", port=8000, model_name="target")  # blocks

or in the background (tests, notebooks), on a free port:

    with ji.server.start(engine, tok, port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

`serve` handles SIGTERM (and Ctrl-C) gracefully: it stops accepting connections and new
requests, lets in-flight requests finish for up to `shutdown_timeout` seconds, aborts the rest,
and returns (so a script's exit status is 0).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import Any

import uvicorn

from jaxinfer.server.app import build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.protocol import APIError


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, srv):
        super().__init__(config)
        self._srv = srv

    def handle_exit(self, sig, frame):
        self._srv.shutting_down = True  # requests on open connections now get 503
        super().handle_exit(sig, frame)


class Server:
    """A configured server: `run()` blocks; `start()` runs it on a thread; `stop()` ends it.

    Args:
      engine: the engine (owned by the server's engine thread from now on).
      tokenizer: encode / decode (`ji.load_tokenizer`), with `chat_template` for chat.
      host: the address to listen on.
      port: the port; 0 picks a free one (see `port` after construction).
      model_name: the model id of the API.
      chat_template: a jinja chat template overriding the tokenizer's.
      max_model_len: the longest prompt + completion admitted; None: the model's positions.
      max_waiting: requests without a first token at once; more get 503 + Retry-After.
      request_log: a JSONL file, one line per finished request; None: off.
      shutdown_timeout: seconds in-flight requests may run after SIGTERM.
      log_level: uvicorn's.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        model_name: str = "model",
        chat_template: str | None = None,
        max_model_len: int | None = None,
        max_waiting: int = 256,
        request_log: str | None = None,
        shutdown_timeout: float = 30.0,
        log_level: str = "warning",
    ):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r}: expected an int >= 1")
        self.metrics = ServerMetrics(model_name, request_log)
        self.engine = AsyncEngine(engine, self.metrics, max_waiting)
        self.app = build_app(self.engine, tokenizer, model_name, chat_template, max_model_len)
        self.shutdown_timeout = shutdown_timeout
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
            access_log=False,
        )
        self._uvicorn = _Uvicorn(config, self.app.state.server)
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        """Whether it accepts connections."""
        return self._uvicorn.started

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serves until SIGTERM / SIGINT (main thread) or `stop()`; then shuts down."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        if main:
            # uvicorn re-raises the signal it caught once it has shut down; a no-op handler
            # then, so a graceful SIGTERM ends with a normal return and exit status 0.
            signal.signal(signal.SIGTERM, lambda *_: None)
        self.engine.start()
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.engine.stop(timeout=0.0)  # uvicorn drained or cancelled the requests already
            self._sock.close()
            if main:
                signal.signal(signal.SIGTERM, previous)

    def start(self) -> Server:
        """Runs the server on a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="jaxinfer-http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        """Graceful stop of a `start()`ed server (in-flight requests get shutdown_timeout s)."""
        self.app.state.server.shutting_down = True
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(engine: Any, tokenizer: Any, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
    """Serves the OpenAI API over `engine` until SIGTERM / Ctrl-C (see `Server` for options)."""
    Server(engine, tokenizer, host, port, **kw).run()


@contextlib.contextmanager
def start(engine: Any, tokenizer: Any, host: str = "127.0.0.1", port: int = 0, **kw):
    """A `Server` running on a background thread for the `with` block, stopped after it."""
    server = Server(engine, tokenizer, host, port, **kw).start()
    try:
        yield server
    finally:
        server.stop()


__all__ = ["APIError", "AsyncEngine", "Server", "ServerMetrics", "build_app", "serve", "start"]
