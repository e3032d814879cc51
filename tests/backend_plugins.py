"""Backends that break on purpose, for the end-to-end tests. They live in a module of their own
so a worker process can import them (``implementation: tests.backend_plugins:Exploding`` in a
suite, or through a test-made entry point)."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import numpy as np

from bertqa_bench.backends import Backend, make_variant


class _Wrapping(Backend):
    """Runs the eager fp32 CPU backend inside, then misbehaves."""

    def prepare(self, ctx):
        self.inner = make_variant("inner", "torch", "cpu").create()
        self.inner.prepare(ctx)
        self.output_names = self.inner.output_names

    def close(self):
        self.inner.close()


class Exploding(_Wrapping):
    def predict(self, batch):
        raise RuntimeError("kaboom on purpose")


class Perturbed(_Wrapping):
    """Noise on the logits: answers move, the gate must notice."""

    def predict(self, batch):
        out = self.inner.predict(batch)
        rng = np.random.default_rng(0)
        return {k: (v + rng.normal(scale=5.0, size=v.shape).astype(np.float32)) for k, v in out.items()}


class Segfault(_Wrapping):
    """predict() kills its own process with SIGSEGV, as a crashing native kernel would."""

    def predict(self, batch):
        os.kill(os.getpid(), signal.SIGSEGV)


class Hang(_Wrapping):
    """predict() never returns, as a deadlocked kernel would."""

    def predict(self, batch):
        while True:
            time.sleep(1)


class Slow(_Wrapping):
    """The eager backend, BERTQA_TEST_SLOW_S seconds slower per batch (default 0): a variant long
    enough to be interrupted while it runs."""

    def predict(self, batch):
        time.sleep(float(os.environ.get("BERTQA_TEST_SLOW_S", "0")))
        return self.inner.predict(batch)


class WrongShape(_Wrapping):
    """Breaks the backend contract: one token short on every per-token output."""

    def predict(self, batch):
        return {k: v[:, :-1] for k, v in self.inner.predict(batch).items()}


class Declared(_Wrapping):
    """A plug-in whose declared variants carry run settings (timeout_s) the bench must honour."""

    variants = {"declared-hang": {"device": "cpu", "timeout_s": 3, "description": "hangs; killed at 3 s"}}

    def predict(self, batch):
        while True:
            time.sleep(1)


class Misdeclared(_Wrapping):
    """A plug-in whose declared variant has a typo'd key (timout_s)."""

    variants = {"misdeclared": {"device": "cpu", "timout_s": 20}}

    def predict(self, batch):
        return self.inner.predict(batch)


@dataclass
class UnderLoadOptions:
    how: str = "raise"  # raise | segfault | hang


class FailsUnderLoad(_Wrapping):
    """Healthy through prepare, warm-up and the bench passes, then fails as soon as LoadGen drives
    it (a call from the SUT's IssueQuery callback or its batcher thread): an exception, a segfault
    or a hang in the middle of a LoadGen run."""

    Options = UnderLoadOptions

    def predict(self, batch):
        import sys

        frame, under_load = sys._getframe(1), False
        while frame is not None:  # called from the SUT's LoadGen callbacks (loadgen_sut.SUT)?
            if frame.f_code.co_filename.endswith("loadgen_sut.py") and frame.f_code.co_name in ("_issue", "serve"):
                under_load = True
                break
            frame = frame.f_back
        if under_load:
            if self.options.how == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.options.how == "hang":
                while True:
                    time.sleep(1)
            raise RuntimeError("kaboom under load")
        return self.inner.predict(batch)


class FailsOnRank1(_Wrapping):
    """A data-parallel rank that fails on its own: rank 1's prepare raises (BERTQA_TEST_HOW=raise,
    the default) or its warm-up never returns (hang); rank 0 is a healthy eager backend."""

    def prepare(self, ctx):
        if os.environ.get("RANK") == "1" and os.environ.get("BERTQA_TEST_HOW", "raise") == "raise":
            raise RuntimeError("kaboom on rank 1")
        super().prepare(ctx)

    def close(self):
        if hasattr(self, "inner"):
            self.inner.close()

    def predict(self, batch):
        if os.environ.get("RANK") == "1":
            while True:
                time.sleep(1)
        return self.inner.predict(batch)
