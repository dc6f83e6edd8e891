"""Starts N local processes under one `jax.distributed` coordinator, waits, and always reaps them.

    python -m jaxinfer.distributed.launch --num_processes 2 --out outdir -- \
        python -m jaxinfer.distributed.worker --requests requests.json --out outdir

The command after `--` is run N times with `--coordinator 127.0.0.1:<free port>
--num_processes N --process_id i` appended, each in its own session (process group), its output
in `<out>/process_<i>.log`. If any process fails, or the deadline passes, every process group
still alive is sent SIGTERM, then SIGKILL after a grace period, and waited for: no process
outlives `launch()`, whatever happens (an exception, Ctrl-C included).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence


class LaunchError(RuntimeError):
    """A process failed or the deadline passed; carries the return codes and log tails."""

    def __init__(self, message: str, returncodes: list[int | None]):
        super().__init__(message)
        self.returncodes = returncodes


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, SIGKILL what is left after `grace` s, reap all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in procs:  # a group outlives its leader: a process that exited may leave children
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        p.wait()  # after SIGKILL of its group: returns at once


def launch(
    command: Sequence[str],
    num_processes: int,
    log_dir: str | os.PathLike,
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    grace: float = 5.0,
) -> list[int]:
    """Runs `command` as processes 0..N-1 of one `jax.distributed` job on localhost.

    Args:
      command: argv of one process, without the coordinator flags (appended per process).
      num_processes: N >= 1.
      log_dir: where `process_<i>.log` (stdout and stderr of process i) go.
      timeout: seconds for the whole job.
      env: the processes' environment (None: this one's).
      grace: seconds between SIGTERM and SIGKILL when stopping.

    Returns:
      The return codes, all 0.

    Raises:
      ValueError: N < 1 or an empty command.
      LaunchError: a process exited non-zero or the deadline passed (every process is reaped
        first); the message holds the failing logs' tails.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: expected an int >= 1")
    if not command:
        raise ValueError("command is empty: expected the argv of one process")
    log_dir = pathlib.Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    timed_out = False
    logs = [log_dir / f"process_{i}.log" for i in range(num_processes)]
    try:
        for i in range(num_processes):
            argv = [*command, "--coordinator", coordinator, "--num_processes",
                    str(num_processes), "--process_id", str(i)]  # fmt: skip
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )  # fmt: skip
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # every one polled: any() would stop early
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait for it in a collective
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        _stop(procs, grace)
    codes = [p.returncode for p in procs]
    if timed_out or any(codes):
        what = f"timed out after {timeout} s" if timed_out else "a process failed"
        tails = "\n".join(
            f"--- process {i} (rc {c}):\n{logs[i].read_text(errors='replace')[-2000:]}"
            for i, c in enumerate(codes)
            if c or timed_out
        )
        raise LaunchError(f"{what}; return codes {codes}\n{tails}", codes)
    return codes


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: launch.py --num_processes N --out DIR -- COMMAND ...")
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num_processes", type=int, required=True)
    ap.add_argument("--out", required=True, help="folder for the processes' logs")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv[:split])
    try:
        launch(argv[split + 1 :], args.num_processes, args.out, timeout=args.timeout)
    except LaunchError as e:
        raise SystemExit(str(e)) from None
    print(f"{args.num_processes} processes finished; logs in {args.out}")


if __name__ == "__main__":
    main()
