"""`SocketConnector`: the KV connector between a prefill process and a decode process, over TCP.

The prefill process listens (`SocketConnector.listen`), the decode process connects
(`SocketConnector.connect`). Messages are framed as a 4-byte big-endian header length, a JSON
header, then `header["nbytes"]` raw bytes:

    prefill -> decode   saved     {info}                  a request's blocks are ready
    prefill -> decode   done      {rid, tokens, reason}   a request that finished at prefill
    prefill -> decode   eos       {count}                 no more requests will come
    decode -> prefill   load      {rid, skip}             send blocks [skip:]
    prefill -> decode   blocks    {rid, arrays} + bytes   the blocks, as numpy bytes
    decode -> prefill   finished  {rid}                   drop what you hold for rid
    decode -> prefill   bye       {}                      the decode side is done

`save` copies the blocks to host memory (one device -> host transfer), so the prefill pool is
free at once; a reader thread on each side answers / collects messages, so neither side's
engine loop ever blocks on the other except in `wait_for_load`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Hashable

import jax
import numpy as np

from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.distributed.connector import KVConnector, Prefilled, kv_bytes

_FIELDS = ("k", "v", "k_scale", "v_scale")


def _send(sock: socket.socket, lock: threading.Lock, header: dict, *payload) -> None:
    """One message; `payload` buffers (numpy arrays, bytes) are sent without a joined copy."""
    views = [  # arrays as raw bytes (float8 and bfloat16 have no buffer-protocol format)
        memoryview(p.reshape(-1).view(np.uint8)) if isinstance(p, np.ndarray) else memoryview(p)
        for p in payload
    ]
    head = json.dumps({**header, "nbytes": sum(v.nbytes for v in views)}).encode()
    with lock:
        sock.sendall(struct.pack(">I", len(head)) + head)
        for v in views:
            sock.sendall(v)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    return header, _recv_exact(sock, header["nbytes"])


def _key(rid: Hashable) -> str:
    return json.dumps(rid)  # request ids travel as JSON: ints and strings round-trip


class SocketConnector(KVConnector):
    """One side of a prefill/decode pair; build it with `listen` (prefill) or `connect` (decode).

    Args:
      sock: the connected socket.
      role: "prefill" or "decode".
      target: decode side: the decode cache's sharding pytree (where loaded blocks go).
    """

    def __init__(self, sock: socket.socket, role: str, target: PagedKVCache | None = None):
        super().__init__()
        if role not in ("prefill", "decode"):
            raise ValueError(f"role={role!r}: expected 'prefill' or 'decode'")
        self.sock, self.role, self.target = sock, role, target
        self._lock = threading.Lock()  # one writer at a time
        self._cv = threading.Condition()
        self._saved: dict[str, tuple[Prefilled, dict[str, np.ndarray]]] = {}  # prefill side
        self._ready: list[Prefilled] = []  # decode side
        self._blocks: dict[str, tuple[dict, bytes]] = {}
        self._loads: dict[str, float] = {}
        self._dropped: set[str] = set()  # decode side: finished before their blocks came
        self.done: list[dict] = []  # decode side: requests that finished at prefill
        self.eos: int | None = None  # decode side: the number of requests the prefill side had
        self.bye = False  # prefill side: the decode side finished
        self.error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def listen(cls, address: str, timeout: float = 120.0) -> SocketConnector:
        """The prefill side: accepts one decode process on `host:port`."""
        host, port = address.rsplit(":", 1)
        with socket.create_server((host, int(port))) as server:
            server.settimeout(timeout)
            sock, _ = server.accept()
        sock.settimeout(None)
        return cls(sock, "prefill")

    @classmethod
    def connect(cls, address: str, target: PagedKVCache, timeout: float = 120.0):
        """The decode side: connects to the prefill process (retrying until it listens)."""
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sock.settimeout(None)
        return cls(sock, "decode", target)

    # ------------------------------------------------------------------------- reader

    def _read(self) -> None:
        try:
            while True:
                header, payload = _recv(self.sock)
                kind = header["type"]
                with self._cv:
                    if kind == "saved":
                        info = header["info"]
                        self._ready.append(Prefilled(**{**info, "prompt": tuple(info["prompt"])}))
                    elif kind == "done":
                        self.done.append(header)
                    elif kind == "eos":
                        self.eos = header["count"]
                    elif kind == "blocks" and header["rid"] in self._dropped:
                        self._dropped.discard(header["rid"])  # aborted during the transfer
                    elif kind == "blocks":  # stamped on arrival: a caller may collect later
                        header["arrived"] = time.perf_counter()
                        self._blocks[header["rid"]] = (header, payload)
                    elif kind == "finished":
                        self._saved.pop(header["rid"], None)
                    elif kind == "bye":
                        self.bye = True
                    self._cv.notify_all()
                if kind == "load":  # answered outside the lock: the send may take a while
                    self._answer_load(header["rid"], header["skip"])
                if kind == "bye":
                    return
        except (ConnectionError, OSError) as e:
            with self._cv:
                if not self.bye:
                    self.error = e
                self._cv.notify_all()

    def _answer_load(self, key: str, skip: int) -> None:
        with self._cv:
            saved = self._saved.get(key)
        if saved is None:  # aborted on the prefill side meanwhile
            _send(self.sock, self._lock, {"type": "blocks", "rid": key, "missing": True})
            return
        info, arrays = saved
        parts = {n: np.ascontiguousarray(a[:, skip:]) for n, a in arrays.items()}
        meta = {n: [list(a.shape), str(a.dtype)] for n, a in parts.items()}
        _send(
            self.sock, self._lock, {"type": "blocks", "rid": key, "arrays": meta}, *parts.values()
        )

    # -------------------------------------------------------------------- prefill side

    def save(self, info: Prefilled, blocks: PagedKVCache) -> None:
        arrays = {
            n: np.asarray(getattr(blocks, n)) for n in _FIELDS if getattr(blocks, n) is not None
        }
        key = _key(info.request_id)
        with self._cv:
            self._saved[key] = (info, arrays)
        _send(self.sock, self._lock, {"type": "saved", "info": dataclasses.asdict(info)})

    def send_done(self, rid: Hashable, tokens: list[int], reason: str | None) -> None:
        _send(
            self.sock, self._lock, {"type": "done", "rid": rid, "tokens": tokens, "reason": reason}
        )

    def send_eos(self, count: int) -> None:
        _send(self.sock, self._lock, {"type": "eos", "count": count})

    def wait_for_bye(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self.bye or self.error is not None, timeout):
                raise TimeoutError(f"no 'bye' from the decode side within {timeout} s")
        if self.error is not None:
            raise self.error

    # --------------------------------------------------------------------- decode side

    def ready(self) -> list[Prefilled]:
        with self._cv:
            new, self._ready = self._ready, []
        return new

    def start_load(self, request_id: Hashable, skip: int) -> None:
        key = _key(request_id)
        self._loads[key] = time.perf_counter()
        _send(self.sock, self._lock, {"type": "load", "rid": key, "skip": int(skip)})

    def wait_for_load(self, request_id: Hashable, timeout: float = 120.0) -> PagedKVCache:
        key = _key(request_id)
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._blocks or self.error, timeout):
                raise TimeoutError(f"no blocks for {request_id!r} within {timeout} s")
            if self.error is not None:
                raise self.error
            header, payload = self._blocks.pop(key)
        if header.get("missing"):
            self._loads.pop(key, None)
            raise RuntimeError(f"the prefill side no longer holds the blocks of {request_id!r}")
        arrays, offset = {}, 0
        for name, (shape, dtype) in header["arrays"].items():
            a = np.frombuffer(payload, dtype, int(np.prod(shape)), offset).reshape(shape)
            arrays[name] = a
            offset += a.nbytes
        blocks = PagedKVCache(
            arrays["k"], arrays["v"], arrays.get("k_scale"), arrays.get("v_scale"),
            kv_format=self.target.kv_format, platform=self.target.platform,
        )  # fmt: skip
        put = time.perf_counter()
        moved = jax.block_until_ready(jax.device_put(blocks, self.target))
        # start_load -> arrival, plus the host -> device copy (not the time before collection)
        start = self._loads.pop(key)
        self.load_seconds += header["arrived"] - start + time.perf_counter() - put
        self.bytes_moved += kv_bytes(moved)
        self.num_loads += 1
        return moved

    def load_arrived(self, request_id: Hashable) -> bool:
        with self._cv:
            return _key(request_id) in self._blocks or self.error is not None

    def send_bye(self) -> None:
        _send(self.sock, self._lock, {"type": "bye"})

    # -------------------------------------------------------------------------- both

    def request_finished(self, request_id: Hashable) -> None:
        key = _key(request_id)
        with self._cv:
            self._saved.pop(key, None)
            if self.role == "decode" and self._loads.pop(key, None) is not None:
                if self._blocks.pop(key, None) is None:
                    self._dropped.add(key)  # its blocks are on the way: drop them on arrival
        if self.role == "decode":
            _send(self.sock, self._lock, {"type": "finished", "rid": key})

    def num_pending(self) -> int:
        with self._cv:
            return len(self._saved) + len(self._loads) + len(self._blocks) + len(self._dropped)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
