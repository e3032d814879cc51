"""Runs a backend variant in its own process, with a time limit, and says how it ended.

Each variant is a fresh ``python -m bertqa_bench.measuring.worker JOB.json`` (spawned, never forked:
nothing of the parent's CUDA context, TF32 switches or compile caches is inherited), in its
own process group so a hung child and anything it started can be killed together. Its output
goes to ``logs/<variant>.log`` in the run folder (and, when asked, to the parent's stderr).

How a child ended becomes the variant's status:

* result file with status ok / not run / failed — what the worker itself reported;
* killed by a signal (segfault, abort, the OOM killer's SIGKILL) — ``failed`` with the signal
  name and the last lines of its log;
* still running at ``timeout_s`` — killed, ``failed`` with "timed out";
* exited without a result file — ``failed`` with the exit code and the log's tail.

The in-process mode calls the worker function directly (tests, debugging): same job, same
result record, none of the isolation.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..config import PROJECT_ROOT
from ..io import atomic_write_json
from .ddp import strip_dist_env
from .interrupt import PARENT_ENV
from .worker import Job, run_job_safely

# NVLink multicast stays off in every process this suite starts: on shared multi-GPU hosts a
# program that uses it can take the host's GPUs out of service (docs/multi-gpu.md).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TAIL_LINES = 15


def child_env(extra: Optional[dict] = None) -> dict:
    # torchrun's variables stay out unless given (``extra``): a worker joins only its own group
    env = strip_dist_env(dict(os.environ))
    env.update(SAFE_ENV)
    # The child must import this same package, installed or not (a copied tree on a GPU machine).
    path = env.get("PYTHONPATH", "")
    root = str(PROJECT_ROOT)
    if root not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _pump(stream, log_path: Path, echo) -> None:
    with open(log_path, "ab") as log:
        for chunk in iter(lambda: stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536), b""):
            log.write(chunk)
            log.flush()
            if echo is not None:
                echo.write(chunk.decode("utf-8", "replace"))
                echo.flush()


class _Child:
    """One worker process: started with its job file, its log pumped, its end explained."""

    def __init__(self, job: "Job", log_path: Path, echo: bool, env: Optional[dict] = None, stdin=subprocess.DEVNULL,
                 pass_fds: tuple = ()):
        self.job, self.log_path = job, Path(log_path)
        self.result_path = Path(job.result)
        job_path = self.result_path.with_suffix(".job.json")
        atomic_write_json(job_path, job.to_dict())
        self.result_path.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self.t0 = time.perf_counter()

        self.proc = subprocess.Popen([sys.executable, "-m", "bertqa_bench.measuring.worker", str(job_path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin,
                                     env=child_env({**(env or {}), PARENT_ENV: str(os.getpid())}),
                                     start_new_session=True, pass_fds=pass_fds)
        # The worker's pid beside its job: what a supervisor (or a test) checks after a kill.
        self.result_path.with_suffix(".pid").write_text(str(self.proc.pid))
        self.pump = threading.Thread(target=_pump, args=(self.proc.stdout, self.log_path, sys.stderr if echo else None),
                                     daemon=True)
        self.pump.start()
        self.timed_out = False
        self.stopped = ""  # why the launcher killed it (another rank failed first)
        self.fail_order: Optional[int] = None  # 1 for the first child that ended badly on its own, 2, ...

    def wait(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            _kill_group(self.proc)

    def kill(self) -> None:
        _kill_group(self.proc)

    def result(self, timeout_s: float) -> dict:
        self.pump.join(timeout=10)
        elapsed, code = time.perf_counter() - self.t0, self.proc.returncode
        if self.timed_out:
            return _failed(f"timed out after {timeout_s:g} s ({limit_setting(timeout_s)}); killed", self.log_path, code,
                           elapsed,
                           timed_out=True)
        if self.stopped:
            return _failed(self.stopped, self.log_path, code, elapsed, stopped_by_peer=True)
        if self.result_path.exists():
            try:
                result = json.loads(self.result_path.read_text())
                result.setdefault("exit_code", code)
                if self.fail_order is not None and result.get("status") != "ok":
                    result["fail_order"] = self.fail_order
                result["wall_s"] = elapsed
                if result.get("status") == "failed":
                    result["log_tail"] = tail(self.log_path)
                return result
            except (OSError, json.JSONDecodeError):
                pass
        if code is not None and code < 0:
            name = _signal_name(-code)
            hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
            return _failed(f"crashed: killed by {name}{hint}", self.log_path, code, elapsed,
                           fail_order=self.fail_order)
        return _failed(f"exited with code {code} without a result", self.log_path, code, elapsed,
                       fail_order=self.fail_order)


def launch_all(jobs: Sequence["Job"], *, timeout_s: float, log_paths: Sequence[Path], echo: bool = False,
               envs: Optional[Sequence[Optional[dict]]] = None, abort: Optional[Callable[[], Optional[str]]] = None,
               poll_s: float = 0.05) -> list[dict]:
    """Run jobs side by side (the ranks of a data-parallel job), each in its own process; one time
    limit for all. As soon as one ends badly (an exception, a signal) the others are killed: they
    would otherwise wait for it in a collective until the group's timeout. ``abort`` (polled):
    a reason to kill them all now (a rank on another host failed), or None."""
    envs = envs or [None] * len(jobs)
    children: list[_Child] = []
    try:
        for job, log_path, env in zip(jobs, log_paths, envs):
            children.append(_Child(job, log_path, echo, env))
        deadline = time.monotonic() + timeout_s
        if len(children) == 1 and abort is None:
            children[0].wait(deadline)
        else:
            _watch(children, deadline, abort, poll_s)
    except BaseException:  # a signal in the parent (interrupt.Interrupted): take the children down too, then stop
        for c in children:
            c.kill()
        raise
    return [c.result(timeout_s) for c in children]


def _watch(children: list, deadline: float, abort, poll_s: float) -> None:
    running, failures, last_abort_check = list(children), 0, 0.0
    while running:
        for c in list(running):
            if c.proc.poll() is None:
                continue
            running.remove(c)
            if c.proc.returncode != 0:
                failures += 1
                c.fail_order = failures
                for other in running:
                    other.stopped = f"stopped: rank {children.index(c)} failed first"
                    other.kill()
                running = []
                break
        now = time.monotonic()
        if running and abort is not None and now - last_abort_check > 0.5:
            last_abort_check = now
            why = abort()
            if why:
                for c in running:
                    c.stopped = why
                    c.kill()
                running = []
        if running and now > deadline:
            for c in running:
                c.timed_out = True
                c.kill()
            running = []
        if running:
            time.sleep(poll_s)


class TimeLimit(float):
    """A time limit in seconds that remembers the setting it came from, so a timeout names the
    one that applied: a variant's own ``timeout_s`` or the suite's ``bench.timeout_s``. A float
    everywhere else (deadlines, job records)."""

    setting: str

    def __new__(cls, seconds: float, setting: str = "bench.timeout_s"):
        obj = super().__new__(cls, seconds)
        obj.setting = setting
        return obj

    def __reduce__(self):  # pickled into bench-ddp's broadcast with its setting
        return (TimeLimit, (float(self), self.setting))


def time_limit(variant, bench_timeout_s: float) -> TimeLimit:
    """The limit a variant runs under: its own timeout_s when it has one, else bench.timeout_s."""
    own = getattr(variant, "timeout_s", None)
    if own:
        return TimeLimit(own, f"variant {variant.name}'s own timeout_s, not bench.timeout_s")
    return TimeLimit(bench_timeout_s, "bench.timeout_s")


def limit_setting(timeout_s: float) -> str:
    return getattr(timeout_s, "setting", "bench.timeout_s")


def launch(job: "Job", *, timeout_s: float, log_path: Path, echo: bool = False, isolation: str = "process") -> dict:
    """Run ``job`` and return its result record (status ok | not run | failed, ...)."""
    if isolation == "inprocess":
        return run_job_safely(job)
    return launch_all([job], timeout_s=timeout_s, log_paths=[log_path], echo=echo)[0]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _failed(reason: str, log_path: Path, code, elapsed: float, **flags) -> dict:
    last = tail(log_path)
    return {"status": "failed", "error": reason + (f"; last output: {last.splitlines()[-1][:300]}" if last else ""),
            "exit_code": code, "log_tail": last, "wall_s": elapsed,
            **{k: v for k, v in flags.items() if v is not None and v is not False}}
