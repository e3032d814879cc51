"""The system under test: one backend variant driven by MLPerf LoadGen, inside its worker process.

``loadgen_job.py`` drives this for a job of kind ``loadgen`` (``launcher.launch`` starts it exactly as it
starts a ``bench`` worker: own process group, time limit, crash and hang isolation). In that
process:

1. prepare the backend (timed) with every shape the scenario can hand it, then warm up: every
   shape of the variant's bench plan and every shape of the scenario, untimed, on real features;
2. (``loadgen.compare_bench``) time the bench passes over the variant's plan, as ``bench`` does
   (runner.timed_passes): the Offline cross-check and the Server peak's share of bench throughput
   come from this same process, and the outputs show that the LoadGen path gives the same answers;
3. LoadGen's accuracy run (AccuracyOnly: every sample of the QSL once), then its performance run
   (or the peak search: one performance run per target QPS), each writing its own
   ``mlperf_log_*`` files under the bundle's ``loadgen/<variant>/``.

The QSL is the evaluation set: LoadGen sample i is feature i (as in MLPerf's BERT), held in RAM.
A response is the feature's outputs as float32 bytes: each token output cut at the feature's real
length (the rest is padding, blanked before postprocessing anyway), then every per-feature
output; ``layout`` records the order so the parent decodes LoadGen's accuracy log (loadgen.py).

How each scenario reaches the backend (``predict``, synchronous, one batch at a time, except in
Offline and Server for a backend that keeps batches in flight):

* SingleStream — in LoadGen's own issue thread (as MLPerf's reference harness): a batch of one
  at the feature's own length, padded up to the variant's shape set (``seq_multiple`` buckets when
  length-aware, ``max_seq_len`` when padded), so compiled graphs and CUDA graphs apply;
* Server — ``IssueQuery`` only queues the sample; a batcher thread sends a batch when it holds
  ``max_batch`` samples or its oldest has waited ``max_wait_us`` (or LoadGen flushes). When the
  variant batches by length (sorted, trimmed, packed) the batch is grouped around the oldest
  sample by length bucket under the plan's token budget; otherwise first come, first served.
  Batch sizes are padded up to a short ladder (repeating a real row), so shapes stay few. When
  length-aware, each length bucket's ladder ends at the most rows its length fits in the token
  budget (rounded down to 8: 80 rows at 384 tokens, 256 at 128 for 32,768 tokens), as the bench's
  plan fills it: a fixed ladder capped long batches at the last power of two under the budget
  (32 rows at 384 for [8, 32, 128]) and padded the rest up to 128 rows (H100, 2026-11-26: a
  mean batch of 73 rows and 72% of bench throughput).
  With a window above one (``loadgen.server_in_flight``, capped by ``Backend.in_flight()``) the
  batcher does not wait for a batch's outputs: it forms and submits the next batch as soon as
  fewer than ``window`` are outstanding, and a collector thread collects each batch in turn (its
  waiter only waits for the device and copies host memory) and hands it to the responder. A
  backend on several CUDA streams then holds a batch on each under Server too; with a window of
  one a batch is collected before the next one is formed;
* Offline — the one query is planned exactly like ``bench`` plans the evaluation set
  (schedule.make_plan with the variant's batching), batches answered as they finish; each
  batch's host arrays are gathered one batch ahead on a helper thread (the bench builds them
  before its clock), which the CPU model of this SUT puts at about +3 points for the packed FP8 row.
  A backend that keeps batches in flight (``Backend.in_flight() > 1``, torch's ``pipeline: true``)
  gets them as the bench's runner hands them over: batch k+1 submitted before batch k is
  collected, so Offline measures what bench measures.

In Server and Offline, a responder thread encodes each batch's answers and hands them to LoadGen
(``QuerySamplesComplete``) while the next batch runs. ``scripts/
loadgen_sut_model.py`` measures this path against a simulated device on any CPU.

A backend error under load must not leave LoadGen waiting forever: the error is kept, every
outstanding and later sample is answered empty so the run ends, and the job then fails with the
error. A crash or hang ends the process; the launcher reports it and the other rows still run.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

from ..record.schedule import Batch, batch_inputs
from .runner import in_flight_window

LENGTH_AWARE = ("sorted", "trimmed", "packed")


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def batch_buckets(max_batch: int, sizes=()) -> list[int]:
    """Batch sizes a Server batch is padded up to: ``sizes`` (those below max_batch) or powers of
    two, and max_batch itself."""
    if sizes:
        return sorted({int(b) for b in sizes if b < max_batch} | {int(max_batch)})
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def server_window(setting: int, backend_in_flight: int) -> int:
    """Server batches outstanding at once: the backend's own window (``setting`` 0) or
    ``setting`` capped by it (a backend refuses more batches than it keeps in flight)."""
    most = max(1, int(backend_in_flight))
    return most if int(setting) == 0 else max(1, min(int(setting), most))


class Shapes:
    """The bounded shape family of a variant under LoadGen: its batching decides the sequence
    length a feature is padded to, ``batch_buckets`` (capped per length by the token budget when
    length-aware) the batch size."""

    def __init__(self, batching: str, max_seq_len: int, seq_multiple: int, max_batch: int, batch_sizes=(),
                 token_budget: int = 0):
        self.batching, self.max_seq_len, self.seq_multiple = batching, int(max_seq_len), int(seq_multiple)
        self.packed = batching == "packed"
        self.length_aware = batching in LENGTH_AWARE
        self.buckets = batch_buckets(max_batch, batch_sizes)
        self.token_budget = int(token_budget or 0)
        self._ladders: dict = {}  # the batcher asks per candidate sample: computed once per length

    def ladder(self, seq: Optional[int] = None) -> list[int]:
        """Batch sizes a batch of rows padded to ``seq`` may take: the buckets, ending at the
        most rows that fit the token budget at that length (length-aware variants only)."""
        if seq is None or not self.length_aware or self.packed or not self.token_budget:
            return self.buckets
        seq = int(seq)
        if seq not in self._ladders:
            fit = self.token_budget // seq
            # the budget binds: round down to a multiple of 8 rows; else the largest bucket fits
            cap = self.buckets[-1] if fit >= self.buckets[-1] else max(1, fit // 8 * 8 if fit >= 8 else fit)
            self._ladders[seq] = sorted({b for b in self.buckets if b < cap} | {cap})
        return self._ladders[seq]

    def seq(self, length: int) -> int:
        if not self.length_aware:
            return self.max_seq_len
        if self.packed:  # the packed plan's rule: real tokens, the array cut at a multiple of 8
            return min(self.max_seq_len, _round_up(max(1, length), 8))
        return min(self.max_seq_len, max(self.seq_multiple, _round_up(length, self.seq_multiple)))

    def rows(self, n: int, seq: Optional[int] = None) -> Optional[int]:
        """The batch size ``n`` rows (padded to ``seq``) are padded up to; None if none fits."""
        if self.packed:  # padding-free backends compute real tokens only: no dummy rows
            return n
        return next((b for b in self.ladder(seq) if b >= n), None)

    def all(self, lengths: np.ndarray, scenario: str) -> set:
        seqs = sorted({self.seq(int(v)) for v in lengths})
        if scenario == "SingleStream":
            return {(1, s) for s in seqs}
        if scenario == "Server":
            if self.packed:
                return {(b, s) for b in (1, self.buckets[-1]) for s in seqs}
            return {(b, s) for s in seqs for b in self.ladder(s)}
        return set()  # Offline: the bench plan's shapes


class Codec:
    """One sample's outputs <-> float32 bytes (the LoadGen response, and its accuracy log entry)."""

    def __init__(self, output_names, token_outputs, example: dict):
        self.layout = [[n, "token" if n in token_outputs else int(np.prod(example[n].shape[1:]))]
                       for n in output_names]

    def encode(self, out: dict, i: int, length: int) -> np.ndarray:
        """Sample ``i``'s answer on its own: the plain definition, which encode_batch must equal
        (the responder uses encode_batch; the tests hold the two together)."""
        parts = [out[n][i, :length] if kind == "token" else np.ravel(out[n][i]) for n, kind in self.layout]
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    def encode_batch(self, out: dict, lengths: np.ndarray) -> tuple[np.ndarray, list, list]:
        """A batch's answers in one float32 buffer: sample k's are ``sizes[k]`` values from
        ``starts[k]``, the same values as ``encode(out, k, lengths[k])``. One masked copy instead
        of numpy calls per sample: the responder holds the GIL while it encodes, and a backend
        whose predict does Python work (the packed rows) waits for it meanwhile."""
        n = len(lengths)
        cols, masks = [], []
        for name, kind in self.layout:
            a = np.asarray(out[name][:n], dtype=np.float32).reshape(n, -1)
            cols.append(a)
            masks.append(np.arange(a.shape[1])[None, :] < np.asarray(lengths)[:, None] if kind == "token"
                         else np.ones(a.shape, dtype=bool))
        mask = np.concatenate(masks, axis=1)
        buf = np.concatenate(cols, axis=1)[mask]  # row-major: each sample's parts in layout order
        sizes = mask.sum(axis=1)
        starts = np.cumsum(sizes) - sizes
        return buf, starts.tolist(), sizes.tolist()


class _InFlight:
    """A submitted Server batch on its way to the collector thread: what ``SUT._submit`` returned."""

    __slots__ = ("submitted", "started")

    def __init__(self, submitted: tuple, started: float):
        self.submitted, self.started = submitted, started  # started: when backend.submit was called


class SUT:
    """The backend behind LoadGen's SystemUnderTest callbacks (see the module docstring)."""

    def __init__(self, lg, backend, inputs: dict, lengths: np.ndarray, codec: Codec, shapes: Shapes, *,
                 scenario: str, max_batch: int, max_wait_us: int, offline_plan: Callable, server_window: int = 1):
        self.lg, self.backend, self.inputs, self.lengths = lg, backend, inputs, lengths
        self.codec, self.shapes, self.scenario = codec, shapes, scenario
        self.max_batch, self.max_wait_s = int(max_batch), max_wait_us / 1e6
        # Server batches outstanding at once (see the module docstring); a permit is taken before a
        # batch is formed and given back once its outputs are on the host
        self.server_window = int(server_window) if scenario == "Server" else 1
        if self.server_window < 1:
            raise ValueError(f"server_window {server_window}: at least one batch")
        self._permits = threading.BoundedSemaphore(self.server_window)
        self.offline_plan = offline_plan
        self.error: Optional[str] = None
        self.reset_counts()
        # each feature's padded length, once (the batcher reads it for every pending sample)
        self.seq_of = np.array([shapes.seq(int(v)) for v in lengths], dtype=np.int64)
        # SingleStream answers on its own thread: a hand-off would only add to the latency
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._responder: Optional[threading.Thread] = None
        if scenario != "SingleStream":
            self._responder = threading.Thread(target=self._respond_loop, name="loadgen-responder", daemon=True)
            self._responder.start()
        # Server batches in flight are collected on a thread of their own, so a batch's end (and
        # its permit) is not held back by the answering of the batch before it
        self._collecting: queue.SimpleQueue = queue.SimpleQueue()
        self._collector: Optional[threading.Thread] = None
        if self.server_window > 1:
            self._collector = threading.Thread(target=self._collect_loop, name="loadgen-collector", daemon=True)
            self._collector.start()
        self._pending: list = []  # (arrival, response id, feature index)
        self._cond = threading.Condition()
        self._flush = False
        self._stop = False
        self.handle = lg.ConstructSUT(self._issue, self._flush_queries)

    # --- LoadGen's callbacks (never raise into LoadGen: a C++ thread would terminate) ---------
    def _issue(self, samples) -> None:
        try:
            items = [(time.perf_counter(), s.id, int(s.index)) for s in samples]
            if self.scenario == "SingleStream" or self.error:
                self._run(items)
                return
            with self._cond:
                self._pending.extend(items)
                self._cond.notify()
        except BaseException as e:  # noqa: BLE001 - see _fail
            self._fail(e, [(0.0, s.id, int(s.index)) for s in samples])

    def _flush_queries(self) -> None:
        with self._cond:
            self._flush = True
            self._cond.notify()

    # --- batches ---------------------------------------------------------------------------
    def serve(self) -> None:
        """The batcher (Server, Offline), on the calling thread until ``finish`` and nothing is
        pending; LoadGen's StartTest runs on another thread meanwhile."""
        self._loop()

    def finish(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _loop(self) -> None:
        in_flight = self.server_window > 1
        while True:
            if in_flight:  # the window's room first: samples keep arriving meanwhile
                self._permits.acquire()
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending:
                    if in_flight:
                        self._permits.release()
                    return
                if self.scenario == "Offline":
                    group, self._pending = self._pending, []
                else:
                    # A batch leaves when full, when its oldest sample has waited max_wait, or at a flush.
                    while len(self._pending) < self.max_batch and not self._flush and not self._stop:
                        left = self._pending[0][0] + self.max_wait_s - time.perf_counter()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    group = self._take()
            try:
                if self.scenario == "Offline":
                    self._offline(group)
                elif in_flight:
                    self._run_in_flight(group)
                else:
                    self._run(group)
            except BaseException as e:  # noqa: BLE001
                self._fail(e, group)

    def _take(self) -> list:
        """The next batch from the queue (called with the lock held)."""
        p = self._pending
        if not self.shapes.length_aware or len(p) <= 1:
            group, self._pending = p[: self.max_batch], p[self.max_batch:]
            return group
        # Length-aware: the oldest sample and those nearest its length bucket (older first among
        # equals, shorter before longer: a longer one pads every row chosen), as long as the
        # batch stays within the plan's token budget and its length's batch ladder.
        # Every ladder size fits the budget at its length, so a padded batch fits while it has no
        # more rows than its longest length's ladder ends at; that end only falls as length grows.
        # (A profile of this batcher at ~7,000 QPS: Python per candidate here took 12% of the
        # backend thread, time the device stood idle; hence arrays and one ordering pass.)
        idx = np.fromiter((i for _, _, i in p), dtype=np.int64, count=len(p))
        seq_a = self.seq_of[idx]
        anchor = int(seq_a[0])
        order = np.lexsort((np.arange(len(p)), seq_a > anchor, np.abs(seq_a - anchor))).tolist()
        seq, lens = seq_a.tolist(), self.lengths[idx].tolist()
        packed, budget, ladder = self.shapes.packed, self.shapes.token_budget, self.shapes.ladder
        chosen, longest, real = [], 0, 0
        for k in order:
            n = len(chosen)
            if n >= self.max_batch or (not packed and n and n >= ladder(longest)[-1]):
                break
            lng, rl = (longest if longest >= seq[k] else seq[k]), real + int(lens[k])
            if n and (rl > budget if packed else n + 1 > ladder(lng)[-1]):
                continue
            chosen.append(k)
            longest, real = lng, rl
        keep = set(chosen)
        group = [p[k] for k in sorted(chosen)]
        self._pending = [x for k, x in enumerate(p) if k not in keep]
        return group

    def _batch(self, rows: np.ndarray) -> dict:
        seq = int(self.seq_of[rows].max())
        b = self.shapes.rows(len(rows), seq)
        if b is None:  # one sample alone always fits; a batch _take formed always fits its ladder
            raise RuntimeError(f"{len(rows)} rows at {seq} tokens fit no batch size of {self.shapes.ladder(seq)}")
        return batch_inputs(self.inputs, Batch(rows, (b, seq)))

    def _respond(self, items: list, out: Optional[dict]) -> None:
        """Hand the batch's answers to LoadGen: from the responder thread when there is one
        (the outputs are the caller's: Backend.predict's contract), else right here."""
        if self._responder is not None:
            self._answers.put((items, out))
        else:
            self._complete(items, out)

    def _complete(self, items: list, out: Optional[dict]) -> None:
        """Every sample handed here is answered: LoadGen waits for each one without a time limit,
        so an answer that cannot be encoded is sent empty and the error kept (the job fails)."""
        lg = self.lg
        buf = None
        try:
            if out is not None:
                lengths = self.lengths[np.fromiter((idx for _, _, idx in items), dtype=np.int64, count=len(items))]
                buf, starts, sizes = self.codec.encode_batch(out, lengths)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exception(e)
            self.error = self.error or f"{type(e).__name__}: {e}"
            buf = None
        # buf stays alive until QuerySamplesComplete has copied what it logs
        if buf is not None:
            base, w = buf.ctypes.data, buf.itemsize
            responses = [lg.QuerySampleResponse(rid, base + w * s, w * n)
                         for (_, rid, _), s, n in zip(items, starts, sizes)]
        else:
            responses = [lg.QuerySampleResponse(rid, 0, 0) for _, rid, _ in items]
        lg.QuerySamplesComplete(responses)

    def _respond_loop(self) -> None:
        """Server and Offline: LoadGen's completion calls run here, beside the next batch on the
        device (the backend thread waits on the device without the GIL). On the backend thread
        they took 7% of its time at ~7,700 QPS, with the device idle meanwhile."""
        while True:
            item = self._answers.get()
            if item is None:
                return
            try:
                self._complete(*item)
            except BaseException as e:  # noqa: BLE001 - LoadGen's own call failed: nothing more to send
                traceback.print_exception(e)
                self.error = self.error or f"{type(e).__name__}: {e}"

    def _run(self, items: list) -> None:
        rows = np.array([i for _, _, i in items], dtype=np.int64)
        self._predict(items, rows, lambda: self._batch(rows))

    def _run_in_flight(self, items: list) -> None:
        """One Server batch submitted, its permit held, its collection left to the collector."""
        handed = False
        try:
            rows = np.array([i for _, _, i in items], dtype=np.int64)
            submitted = self._submit(items, rows, lambda: self._batch(rows))
            if submitted is not None:  # else answered empty already: nothing is outstanding
                self._collecting.put(_InFlight(submitted, time.perf_counter() - submitted[4]))
                handed = True
        finally:
            if not handed:  # a permit kept here would shrink the window for the rest of the run
                self._permits.release()

    def _collect_loop(self) -> None:
        """Server batches in flight, collected in submission order and handed to the responder."""
        while True:
            batch = self._collecting.get()
            if batch is None:
                return
            self._answers.put(self._collect_in_flight(batch))

    def _collect_in_flight(self, batch: "_InFlight") -> tuple:
        """Wait for a Server batch's outputs, give its permit back, and return what ``_complete``
        answers. A failure is kept before the permit returns, so every batch formed after it is
        answered empty (those already in flight still run)."""
        items, rows, shape, wait, _ = batch.submitted
        out = None
        try:
            out = wait()
            # predict time is the union of the batches' spans (backend.submit called to outputs
            # collected): they overlap, and a sum would count the overlap twice. Batches are
            # submitted and collected in order, so each adds what lies past the one before.
            done = time.perf_counter()
            self._count(rows, shape, max(0.0, done - max(batch.started, self._spans_end)))
            self._spans_end = done
        except BaseException as e:  # noqa: BLE001
            traceback.print_exception(e)
            self.error = self.error or f"{type(e).__name__}: {e}"
            out = None
        self._permits.release()
        return items, out

    def _predict(self, items: list, rows: np.ndarray, inputs: Callable[[], dict]) -> None:
        """One batch (Server, SingleStream), submitted and collected at once."""
        submitted = self._submit(items, rows, inputs)
        if submitted is not None:
            self._collect(*submitted)

    def reset_counts(self) -> None:
        """Batches, rows, real and computed tokens (padding included) and the seconds spent in
        the backend's predict since the last reset (with Server batches in flight: the union of
        their spans, submission to collection)."""
        self.batches = self.batch_rows = self.tokens_real = self.tokens_computed = 0
        self.predict_s = 0.0
        self._spans_end = 0.0  # where the in-flight batches' span union has reached

    def _count(self, rows: np.ndarray, shape, predict_s: float) -> None:
        real = int(self.lengths[rows].sum())
        self.predict_s += predict_s
        self.batches += 1
        self.batch_rows += len(rows)
        self.tokens_real += real
        self.tokens_computed += real if self.shapes.packed else int(shape[0]) * int(shape[1])

    def _offline(self, items: list) -> None:
        """LoadGen's one Offline query, planned as ``bench`` plans the evaluation set. A backend
        that keeps batches in flight (``Backend.in_flight() > 1``) gets them as the bench's
        runner hands them over: batch k+1 submitted before batch k is collected."""
        idx = np.array([i for _, _, i in items], dtype=np.int64)
        plan = self.offline_plan(self.lengths[idx])
        # Each batch's host arrays are built on a helper thread while the batch before it runs
        # (predict waits on the device without the GIL): the bench builds them all before its
        # clock starts, so gathering them in turn here was time the device stood idle.
        with ThreadPoolExecutor(1, thread_name_prefix="loadgen-inputs") as pool:
            def gather(k: int):
                b = plan.batches[k]
                return pool.submit(batch_inputs, self.inputs, Batch(idx[b.rows], b.shape))

            def submitted():
                ahead = gather(0) if plan.batches else None
                for k, b in enumerate(plan.batches):
                    current, ahead = ahead, (gather(k + 1) if k + 1 < len(plan.batches) else None)
                    one = self._submit([items[r] for r in b.rows], idx[b.rows], current.result)
                    if one is not None:
                        yield one

            # the bench runner's own window: batch k+1 submitted before batch k is collected
            for one in in_flight_window(submitted(), self.backend.in_flight()):
                self._collect(*one)

    def _submit(self, items: list, rows: np.ndarray, inputs: Callable[[], dict]) -> Optional[tuple]:
        """Hand one batch to the backend (its host arrays from ``inputs()``; a synchronous backend
        computes it here); returns what ``_collect`` takes for its answers. After an error,
        answered empty at once (None)."""
        if self.error:
            self._respond(items, None)
            return None
        try:
            x = inputs()
            t0 = time.perf_counter()
            wait = self.backend.submit(x)
            return items, rows, x["input_ids"].shape, wait, time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            self._fail(e, items)
            return None

    def _collect(self, items: list, rows: np.ndarray, shape, wait: Callable[[], dict], submit_s: float) -> None:
        """A submitted batch's outputs, answered; its predict time is the time this thread spent
        in the backend for it (its submit and its wait), so overlapped batches are not counted
        twice."""
        try:
            t0 = time.perf_counter()
            out = wait()
            dt = submit_s + time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            self._fail(e, items)
            return
        self._count(rows, shape, dt)
        self._respond(items, out)

    def _fail(self, e: BaseException, items: list) -> None:
        """Keep the first error; answer these samples empty so LoadGen can finish its run."""
        if self.error is None:
            traceback.print_exception(e)
            self.error = f"{type(e).__name__}: {e}"
        try:
            self._respond(items, None)
        except BaseException:  # noqa: BLE001 - nothing more can be done for these samples
            traceback.print_exc()

    def close(self) -> None:
        if self._collector is not None:  # first: what it collects still goes to the responder
            self._collecting.put(None)
            self._collector.join()
            self._collector = None
        if self._responder is not None:
            self._answers.put(None)
            self._responder.join()
            self._responder = None
        self.lg.DestroySUT(self.handle)


