"""Progress that suits where the output goes: a bar on a terminal, a plain line every few
seconds in a log (CI, a device run's captured output), nothing when disabled."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, desc: str, *, enabled: bool = True, unit: str = "it", every_s: float = 15.0,
                 stream=None):
        self.total, self.desc, self.unit, self.every_s = int(total), desc, unit, float(every_s)
        self.stream = stream or sys.stderr
        self.n, self.postfix = 0, ""
        self._bar = None
        self._enabled = enabled
        self._t0 = self._last = time.perf_counter()
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)

    def update(self, n: int = 1, postfix: Optional[str] = None) -> None:
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if self._bar is not None:
            self._bar.update(n)
            if postfix is not None:
                self._bar.set_postfix_str(postfix)
            return
        now = time.perf_counter()
        if self._enabled and now - self._last >= self.every_s:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        rate = self.n / max(now - self._t0, 1e-9)
        extra = f" {self.postfix}" if self.postfix else ""
        left = f", about {clock((self.total - self.n) / rate)} left" if rate > 0 and self.n < self.total else ""
        print(f"{self.desc}: {self.n}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s{left}){extra}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled and self.n and time.perf_counter() - self._t0 >= self.every_s:
            self._line(time.perf_counter())  # a last line for long runs; short ones stay quiet


def clock(seconds: float) -> str:
    """1:05:09 or 4:07."""
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def rows_eta(done_s: list, rows_left: int) -> Optional[float]:
    """Seconds the ``rows_left`` rows of a run still need, from the rows timed so far: each at
    the mean of the finished rows after the first (the reference, which every run starts with and
    which is usually the slowest), or at the reference's time while it is the only one. None
    before any row has finished."""
    if not done_s:
        return None
    others = done_s[1:]
    per_row = sum(others) / len(others) if others else done_s[0]
    return per_row * rows_left


def rows_line(index: int, total: int, name: str, done_s: list, elapsed_s: float) -> str:
    """``rows: 2 of 3 (openvino-fp32) after 1:42; about 1:10 left``: what a run prints before each block-timed row."""
    eta = rows_eta(done_s, total - index)
    return (f"rows: {index + 1} of {total} ({name}) after {clock(elapsed_s)}; "
            + ("an estimate of what is left follows the first row" if eta is None else f"about {clock(eta)} left"))


def quiet_library_bars(stream=None) -> None:
    """When output is not a terminal, silence the progress bars of transformers and the hub
    (one line per update in a log: "Loading weights", "Writing model shards")."""
    stream = stream or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        pass
