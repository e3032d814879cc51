"""Stopping a run cleanly, and never leaving a worker behind.

The parent side: ``interruptible()`` turns SIGTERM, SIGINT and SIGHUP (what a job scheduler, a
timeout, a preempted cloud machine or Ctrl-C send) into ``Interrupted``, raised in the main
thread wherever it is. It subclasses KeyboardInterrupt, so ``except Exception`` blocks (a
backend's failure, a tracking problem) never swallow it, and everything that already cleans up
on Ctrl-C (the launcher kills its children's process groups; a training run ends KILLED) does
so for every signal. The bench then records the run as ``interrupted`` with the verdict of what
finished, ends its MLflow runs KILLED and exits 128 + the signal's number (130, 143, 129).

The worker side: ``watch_parent()`` makes a worker whose parent died without cleaning up (kill
-9, an OOM kill) take its own process group down, so nothing keeps a GPU busy: a parent-death
signal from the kernel where there is one (Linux), and a watchdog thread on the parent's pid
everywhere.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Iterator

SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGHUP")) if s is not None)
PARENT_ENV = "BERTQA_PARENT_PID"


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by a signal."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.signal_name = signal.Signals(self.signum).name
        super().__init__(f"interrupted by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def as_interrupted(e: BaseException) -> Interrupted:
    """A bare KeyboardInterrupt (Ctrl-C outside ``interruptible``) reads as SIGINT."""
    return e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, the first of SIGTERM/SIGINT/SIGHUP raises ``Interrupted``; later ones
    are ignored while the run cleans up (a second Ctrl-C must not leave the bundle half-written)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"fired": False}

    def handler(signum, frame):
        if state["fired"]:
            print(f"\n{signal.Signals(signum).name} again: still cleaning up", file=sys.stderr)
            return
        state["fired"] = True
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _die_with_group() -> None:
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this worker and whatever it started (compile workers)
    finally:
        os._exit(137)


def watch_parent(poll_s: float = 0.5) -> None:
    """In a worker: exit, with everything the worker started, as soon as its parent is gone."""
    want = os.environ.get(PARENT_ENV)
    if not want:
        return
    parent = int(want)
    if sys.platform.startswith("linux"):
        try:  # PR_SET_PDEATHSIG: the kernel signals us when the parent thread exits
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)
            signal.signal(signal.SIGTERM, lambda *_: _die_with_group())
        except (OSError, AttributeError, ValueError):
            pass

    def watch():
        while True:
            if os.getppid() != parent:
                _die_with_group()
            time.sleep(poll_s)

    if os.getppid() != parent:  # the parent died before we got here
        _die_with_group()
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
