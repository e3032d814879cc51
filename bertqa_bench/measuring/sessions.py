"""A row that stays alive between its timed passes: the parent's handle on it in interleaved rounds.

``WorkerSession`` is a row's own spawned worker process (launcher.py's, same job file, log and
time limit) running ``worker.serve_rounds``: it prepares and warms up, says ``ready``, then times
one pass each time the parent writes ``pass`` on its standard input and answers with the
seconds on a pipe of its own; ``finish`` makes it write its outputs and result record and exit,
exactly as a block-timed worker does. ``InProcessSession`` is the same in this process
(``bench.isolation: inprocess``: tests, debugging).

Every session answers the same calls: ``start`` (prepare; returns the ready facts, or None if it
ended: then ``result`` says how), ``run_pass`` (seconds; raises ``SessionEnded`` if the process
died, hung or failed), ``finish`` (the result record), ``kill``.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Optional

from ..errors import BackendUnavailableError, BenchError, format_error
from .launcher import _Child
from .runner import RunOutput
from .worker import REPLY_FD_ENV, Job, prepared, ready_facts, record_of, save_outputs


class SessionEnded(BenchError):
    """The row's process ended (or was killed) before it answered."""


class WorkerSession:
    """One row's worker process, driven pass by pass over two pipes."""

    def __init__(self, job: Job, log_path: Path, timeout_s: float, echo: bool = False):
        self.job, self.name, self.timeout_s = job, job.name, timeout_s
        self.log_path, self.echo = Path(log_path), echo
        self.child: Optional[_Child] = None
        self._reply_r: Optional[int] = None
        self._buffer = b""
        self.ready: Optional[dict] = None
        self._result: Optional[dict] = None

    def start(self) -> Optional[dict]:
        read_fd, write_fd = os.pipe()
        try:
            self.child = _Child(self.job, self.log_path, self.echo, env={REPLY_FD_ENV: str(write_fd)},
                                stdin=subprocess.PIPE, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the child holds its own copy: EOF here once it ends
        self._reply_r = read_fd
        message = self._read(self.timeout_s)
        if message is None:
            return None
        self.ready = message
        return message

    def run_pass(self) -> float:
        self._send("pass")
        message = self._read(self.timeout_s)
        if message is None or message.get("event") != "pass":
            raise SessionEnded(self.result().get("error", "ended"))
        return float(message["seconds"])

    def finish(self) -> dict:
        if self._result is None:
            try:
                self._send("finish")
                self.child.proc.stdin.close()
            except (OSError, SessionEnded):
                pass
            self.child.wait(time.monotonic() + self.timeout_s)
        return self.result()

    def result(self) -> dict:
        """How it ended (launcher._Child's rules: its result file, a signal, a timeout)."""
        if self._result is None:
            if self.child.proc.poll() is None:
                self.child.kill()
            self._result = self.child.result(self.timeout_s)
            self._close_pipe()
        return self._result

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()
        self._close_pipe()

    # --- the pipes ------------------------------------------------------------------------------
    def _send(self, command: str) -> None:
        try:
            self.child.proc.stdin.write((command + "\n").encode())
            self.child.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise SessionEnded(f"{self.name}: its process is gone ({e})") from None

    def _read(self, timeout_s: float) -> Optional[dict]:
        """The next reply line, or None when the process ended (or was killed at the time limit)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.child.timed_out = True
                self.child.kill()
                return None
            ready, _, _ = select.select([self._reply_r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._reply_r, 65536)
            if not chunk:  # the child ended: its result file (or its exit) says how
                self.child.wait(time.monotonic() + 10)
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _close_pipe(self) -> None:
        if self._reply_r is not None:
            os.close(self._reply_r)
            self._reply_r = None


class InProcessSession:
    """The same row in this process (``bench.isolation: inprocess``): no isolation, same record."""

    def __init__(self, job: Job):
        self.job, self.name = job, job.name
        self.run = None
        self.plan = None
        self.ready: Optional[dict] = None
        self._result: Optional[dict] = None

    def start(self) -> Optional[dict]:
        try:
            self.run, self.plan = prepared(self.job, laps=True)
            if self.run is None:
                self._result = {"status": "not run", "error": self.plan}
                return None
            self.run.prepare()
            self.ready = {"event": "ready", **ready_facts(self.run)}
            return self.ready
        except Exception as e:  # noqa: BLE001 - this row's failure, as a worker would report it
            self._fail(e)
            return None

    def run_pass(self) -> float:
        try:
            return self.run.run_pass()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            raise SessionEnded(self._result["error"]) from e

    def finish(self) -> dict:
        if self._result is None:
            try:
                out: RunOutput = self.run.finish()
                save_outputs(self.job.outputs, out.outputs)
                self._result = record_of(out, self.job, self.plan)
            except Exception as e:  # noqa: BLE001
                self._fail(e, close=False)
            finally:
                self.run.close()
        return self._result

    def result(self) -> dict:
        return self._result or {"status": "failed", "error": "ended before finishing"}

    def kill(self) -> None:
        if self.run is not None and self._result is None:
            self.run.close()
            self._result = {"status": "failed", "error": "stopped"}

    def _fail(self, e: BaseException, close: bool = True) -> None:
        if close and self.run is not None:
            self.run.close()
        status = "not run" if isinstance(e, BackendUnavailableError) else "failed"
        self._result = {"status": status, "error": str(e) if status == "not run" else format_error(e)}
