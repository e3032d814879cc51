"""The run's answer first: which backend to run, how much faster it is, and whether its answers
are the same, from the run's own records (``results.BackendResult`` with the parity fields that
``parity.compare`` filled). Pure: records in, a ``Recommendation`` out; the console, summary.md
and the MLflow parent run show it.

The rules:

* a candidate is a row that ran and whose parity is a *decided* pass (``pass``, not within the
  noise of the questions). The reference is the yardstick, never a candidate; rows on another
  number of devices than the reference (data-parallel) are another amount of hardware and are
  left out;
* bench and sweep: the fastest candidate by its speedup over the reference (paired rounds, same
  run) among those **decidedly faster** than the reference: the low end of its speedup interval
  above 1.0. Other such candidates whose intervals overlap its interval are named as within
  noise of it; between equal speedups, the FP32-class row wins, then the lower peak memory, then
  the run's order. Beside it, the fastest decidedly faster FP32-class candidate (fp32, tf32: held
  to the FP32 tolerance, answers unchanged) when that is another row. When no candidate of a
  class is decidedly faster, the recommendation for that class is to stay on the reference, with
  the closest row and its interval. A sweep's best is a configuration (batch size and batching
  of a backend);
* LoadGen: the highest QPS among candidates LoadGen called VALID (in Server, VALID means the
  latency bound held); SingleStream: the lowest 90th-percentile latency;
* rows faster than the recommended one that are not candidates are named with the reason;
* nothing is recommended when no row passes decidedly (each row's reason is given), when the
  reference did not run, or when the run found a problem of its own (a reference that is not
  deterministic makes every comparison doubtful);
* a ranking by speed is only as good as the timings: the reference and candidates timed on a busy
  machine (``timing_reliable`` False, measuring/machine_state.py) are named beside it, and the
  one-line headline says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..backends.base import FP32_CLASS
from ..record.parity import noise_note


@dataclass(frozen=True)
class Choice:
    """One recommended row, with what the recommendation says of it."""

    backend: str
    precision: str
    parity_class: str
    batching: str
    batch_size: Optional[int]
    speedup: Optional[float]
    speedup_low: Optional[float]
    speedup_high: Optional[float]
    speedup_within_noise: bool
    features_per_s: Optional[float]
    prepare_s: Optional[float]
    peak_host_mib: Optional[float]
    peak_gpu_mib: Optional[float]
    answer_agreement: Optional[float]
    agreement_low: Optional[float]
    agreement_high: Optional[float]
    delta: Optional[float]  # primary metric, backend - reference
    delta_low: Optional[float]
    delta_high: Optional[float]
    scenario: str = ""
    achieved_qps: Optional[float] = None
    p90_ms: Optional[float] = None
    p99_ms: Optional[float] = None
    bound_ms: Optional[float] = None
    ties: tuple = ()  # candidates within noise of this one (their timed passes overlap)


@dataclass(frozen=True)
class Recommendation:
    reference: str
    metric_label: str  # the primary metric's label, e.g. F1
    kind: str  # bench | sweep | loadgen
    best: Optional[Choice] = None
    fp32: Optional[Choice] = None  # the fastest FP32-class candidate, when it is not ``best``
    passed_over: tuple = ()  # (backend, why) of rows faster than ``best`` that are not candidates
    why_none: tuple = ()  # why nothing is recommended: one line each
    left_out: tuple = ()  # data-parallel rows, not compared with one-device rows
    busy: tuple = ()  # the reference and candidates timed on a busy machine: the ranking may not hold
    # no candidate decidedly faster than the reference: the closest of them (stay on the reference)
    stay: Optional[Choice] = None
    fp32_stay: Optional[Choice] = None  # the same within the FP32 class
    noisy: bool = False  # a row's noise sensor wandered: the host's for a CPU row, the GPU's for a GPU row (record/noise.py)

    # --- views --------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        """The recommendation as a heading and bullet lines (console and summary.md alike)."""
        head = f"Recommendation (from this run, against {self.reference}; only decided parity passes count):"
        if self.best is None and self.stay is not None:
            return [head, f"- Stay on {self.reference} here: no row that keeps parity is decidedly faster (its "
                          f"speedup interval above 1.0); closest: {self._describe(self.stay)}", *self._tail()]
        if self.best is None:
            return [head, "- None: no backend passed parity decidedly."] + [f"  - {w}" for w in self.why_none]
        lead = {"sweep": "Best configuration", "loadgen": self._loadgen_lead()}.get(self.kind, "Fastest")
        out = [head, f"- {lead}: {self._describe(self.best)}"]
        if self.best.ties:
            out.append(f"  - within noise of it (speedup intervals overlap): {', '.join(self.best.ties)}")
        if self.fp32 is not None:
            out.append(f"- FP32 class (answers unchanged): {self._describe(self.fp32)}")
        elif self.best.parity_class == FP32_CLASS:
            out.append("- Its answers are unchanged: it is FP32 class.")
        elif self.fp32_stay is not None:
            out.append(f"- FP32 class (answers unchanged): stay on {self.reference} here; no FP32-class row is "
                       f"decidedly faster; closest: {self._describe(self.fp32_stay)}")
        return out + self._tail()

    def _tail(self) -> list[str]:
        out = []
        for name, why in self.passed_over:
            out.append(f"- Faster but not recommended: {name}: {why}")
        if self.left_out:
            out.append(f"- Left out (data-parallel, more hardware than the reference): {', '.join(self.left_out)}")
        if self.busy:
            out.append(f"- ⚠ Timed on a busy machine: {', '.join(self.busy)}; this ranking by speed may not hold, "
                       "rerun on an idle machine")
        if self.noisy:
            out.append("- ~ Timed while noisy (the noise sensor of a row wandered: the host's calibration for a CPU "
                       "row, the GPU sensor for a GPU row): the intervals above are paired per round, and a row whose "
                       "interval straddles 1.0 cannot be told apart from the reference here")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def headline(self) -> str:
        """One line (the MLflow parent's ``recommendation`` tag)."""
        if self.best is None and self.stay is not None:
            return (f"stay on {self.reference}: no row decidedly faster (closest {self.stay.backend}: "
                    f"{_speedup(self.stay, self.reference)})")
        if self.best is None:
            return "none: " + (self.why_none[0] if self.why_none else "no backend passed parity decidedly")
        b = self.best
        speed = (f"{b.achieved_qps:,.1f} QPS" if b.scenario and b.scenario != "SingleStream" and b.achieved_qps
                 else f"p90 {b.p90_ms:.2f} ms" if b.scenario == "SingleStream" and b.p90_ms
                 else _speedup(b, self.reference))
        return f"{b.backend}: {speed}, {b.precision}, parity pass" + (" (timing unreliable)" if self.busy else "")

    def tags(self) -> dict:
        """The MLflow parent run's tags (the runs table can show them as columns)."""
        fp32 = self.fp32 or (self.best if self.best is not None and self.best.parity_class == FP32_CLASS else None)
        best = self.best.backend if self.best else (self.reference if self.stay is not None else "")
        fp32_name = fp32.backend if fp32 else (self.reference if self.stay is not None or self.fp32_stay else "")
        return {"recommendation": self.headline(), "recommended_backend": best, "recommended_fp32_backend": fp32_name}

    # --- pieces -------------------------------------------------------------------------------
    def _loadgen_lead(self) -> str:
        b = self.best
        if b is None or b.scenario == "SingleStream":
            return "Lowest SingleStream p90 latency"
        if b.scenario == "Server":
            return "Highest Server QPS" + (f" within the {b.bound_ms:g} ms bound" if b.bound_ms else " within the bound")
        return f"Highest {b.scenario} QPS"

    def _describe(self, c: Choice) -> str:
        what = [c.precision, f"{c.batching} batching"] + ([f"batch {c.batch_size}"] if self.kind == "sweep" and c.batch_size
                                                         else [])
        parts = []
        if c.scenario:
            if c.scenario == "SingleStream":
                parts.append(f"p90 {_f(c.p90_ms, '.2f')} ms")
            else:
                parts.append(f"{_f(c.achieved_qps, ',.1f')} QPS" + (f", p99 {c.p99_ms:.1f} ms" if c.p99_ms else ""))
            if c.speedup is not None:
                parts.append(f"{c.speedup:.2f}× {self.reference}'s")
        else:
            parts.append(_speedup(c, self.reference) + (" (its interval straddles 1.0: not distinguishable)"
                                                        if c.speedup_within_noise else ""))
            if c.features_per_s is not None:
                parts.append(f"{c.features_per_s:,.0f} features/s")
        if c.answer_agreement is not None:
            ci = (f" [{c.agreement_low:.1%}–{c.agreement_high:.1%}]" if c.agreement_low is not None else "")
            parts.append(f"answers {c.answer_agreement:.1%} identical{ci}")
        if c.delta is not None:
            ci = f" [{c.delta_low:+.2f}, {c.delta_high:+.2f}]" if c.delta_low is not None else ""
            parts.append(f"Δ{self.metric_label} {c.delta:+.2f}{ci}")
        if c.prepare_s is not None:
            parts.append(f"prepare {c.prepare_s:.1f} s")
        mem = [f"{c.peak_host_mib:,.0f} MiB host"] if c.peak_host_mib is not None else []
        mem += [f"{c.peak_gpu_mib:,.0f} MiB GPU"] if c.peak_gpu_mib is not None else []
        if mem:
            parts.append("peak " + " / ".join(mem))
        return f"{c.backend} ({', '.join(what)}): " + "; ".join(parts)


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _speedup(c: Choice, reference: str) -> str:
    """``4.62× eager-fp32 [4.53–4.71]``: the median ratio and its interval (rounds: what a rerun shows)."""
    if c.speedup is None:
        return f"— (no speedup against {reference})"
    ci = f" [{c.speedup_low:.2f}–{c.speedup_high:.2f}]" if c.speedup_low is not None and c.speedup_high is not None else ""
    return f"{c.speedup:.2f}× {reference}{ci}"


# --- the rules ----------------------------------------------------------------------------------
def decided_pass(r) -> bool:
    return r.status == "ok" and r.parity == "pass" and not r.parity_within_noise


def why_not(r) -> str:
    """Why a row is not a candidate, in a few words."""
    if r.status != "ok":
        return f"{r.status}: {_short(r.error)}"
    if getattr(r, "scenario", "") and r.loadgen_result != "VALID":
        return f"LoadGen {r.loadgen_result or '?'}: {_short(r.loadgen_invalid_reason)}"
    if r.parity == "FAIL":
        return f"parity FAIL{' (' + noise_note(r) + ')' if r.parity_within_noise else ''}: {_short(r.parity_failures)}"
    if r.parity == "pass" and r.parity_within_noise:
        return f"parity pass, not decided ({noise_note(r)})"
    if r.parity == "n/a":
        return "no parity verdict (random weights: timing only; parity is judged on a trained model)"
    return "not compared with the reference"


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _peaks(r) -> tuple[Optional[float], Optional[float]]:
    host = [v for v in (r.prepare_host_peak_mib, r.predict_host_peak_mib) if v is not None]
    gpu = r.predict_device_used_mib if r.predict_device_used_mib is not None else r.predict_cuda_reserved_peak_mib
    return (max(host) if host else None), gpu


def _choice(r, primary: str, ties=()) -> Choice:
    host, gpu = _peaks(r)
    ci = (r.delta_ci or {}).get(primary)
    return Choice(r.backend, r.precision, r.parity_class, r.batching or "padded", r.batch_size, r.speedup,
                  r.speedup_low, r.speedup_high, bool(r.speedup_within_noise), r.features_per_s, r.prepare_s, host, gpu,
                  r.answer_agreement, r.agreement_ci_low, r.agreement_ci_high, (r.deltas or {}).get(primary),
                  ci[0] if ci else None, ci[1] if ci else None, getattr(r, "scenario", ""),
                  getattr(r, "achieved_qps", None), getattr(r, "sample_latency_p90_ms", None),
                  getattr(r, "sample_latency_p99_ms", None), getattr(r, "target_latency_ms", None), tuple(ties))


def _score(r) -> Optional[float]:
    """Higher is better: QPS in Server/Offline, 1/p90 in SingleStream, the speedup in a bench."""
    if getattr(r, "scenario", ""):
        if r.scenario == "SingleStream":
            return 1.0 / r.sample_latency_p90_ms if r.sample_latency_p90_ms else None
        return r.achieved_qps
    return r.speedup if r.speedup is not None else r.features_per_s


def decidedly_faster(r) -> bool:
    """The low end of the row's speedup interval is above 1.0: faster than the reference beyond
    what a rerun would undo. A row with no interval (one round) is not."""
    return r.speedup_low is not None and r.speedup_low > 1.0


def _overlap(a, b) -> bool:
    """The speedup intervals (else the timed passes) of two rows overlap: this run does not tell them apart."""
    if getattr(a, "scenario", ""):
        return _score(a) == _score(b)
    bounds = [getattr(x, k, None) for x in (a, b) for k in ("speedup_low", "speedup_high")]
    if None not in bounds:
        a_low, a_high, b_low, b_high = bounds
        return a_low <= b_high and b_low <= a_high
    if None in (a.predict_min_s, a.predict_max_s, b.predict_min_s, b.predict_max_s) or a.n_features != b.n_features:
        return a.speedup == b.speedup
    return a.predict_min_s <= b.predict_max_s and b.predict_min_s <= a.predict_max_s


def recommend(results: Sequence, reference: str, *, primary_metric: str = "f1", metric_label: str = "",
              problems: Sequence[str] = (), kind: Optional[str] = None) -> Recommendation:
    """The run's recommendation (see the module's docstring for the rules)."""
    rows = list(results)
    if kind is None:
        kind = ("loadgen" if any(getattr(r, "scenario", "") for r in rows)
                else "sweep" if any("@b" in r.backend for r in rows) else "bench")
    label = metric_label or primary_metric
    base = dict(reference=reference, metric_label=label, kind=kind)
    ref = next((r for r in rows if r.backend == reference), None)
    if ref is None or ref.status != "ok":
        why = "it never ran" if ref is None else f"{ref.status}: {_short(ref.error)}"
        return Recommendation(**base, why_none=(f"the reference {reference} did not run ({why})",))
    if problems:
        return Recommendation(**base, why_none=tuple(f"the run has a problem of its own: {_short(p)}" for p in problems))
    others = [r for r in rows if r.backend != reference]
    devices = ref.n_devices or 1
    left_out = tuple(r.backend for r in others if (r.n_devices or 1) != devices)
    others = [r for r in others if (r.n_devices or 1) == devices]
    if not others:
        return Recommendation(**base, left_out=left_out, why_none=(
            f"only the reference {reference} ran" + (" on this many devices" if left_out else "")
            + ": there is nothing to compare it with",))
    candidates = [r for r in others if decided_pass(r) and _score(r) is not None
                  and (not getattr(r, "scenario", "") or r.loadgen_result == "VALID")]
    if not candidates:
        return Recommendation(**base, left_out=left_out, why_none=tuple(f"{r.backend}: {why_not(r)}" for r in others))
    order = {r.backend: i for i, r in enumerate(rows)}

    def rank(r):  # the fastest first; between equal speeds FP32 class, then lower peak memory, then run order
        host, gpu = _peaks(r)
        mem = gpu if gpu is not None else host
        return (-_score(r), r.parity_class != FP32_CLASS, mem if mem is not None else float("inf"), order[r.backend])

    candidates.sort(key=rank)
    busy = tuple(r.backend for r in [ref, *candidates] if getattr(r, "timing_reliable", None) is False)
    noisy = any(getattr(r, "timing_noisy", None) for r in [ref, *candidates])
    if kind != "loadgen":  # a bench or sweep names only rows decidedly faster than the reference
        return _by_speedup(base, others, candidates, primary_metric, left_out, busy, noisy)
    best = candidates[0]
    ties = [r.backend for r in candidates[1:] if _overlap(best, r)]
    fp32 = next((r for r in candidates if r.parity_class == FP32_CLASS), None)
    fp32_ties = [r.backend for r in candidates if fp32 is not None and r is not fp32 and r.parity_class == FP32_CLASS
                 and _overlap(fp32, r)]
    passed_over = tuple((r.backend, why_not(r)) for r in others
                        if r not in candidates and _score(r) is not None and _score(r) > _score(best))
    return Recommendation(**base, best=_choice(best, primary_metric, ties),
                          fp32=_choice(fp32, primary_metric, fp32_ties) if fp32 is not None and fp32 is not best else None,
                          passed_over=passed_over, left_out=left_out, busy=busy)


def _by_speedup(base: dict, others: list, candidates: list, primary: str, left_out: tuple, busy: tuple,
                noisy: bool) -> Recommendation:
    """A bench's or sweep's recommendation: the fastest candidate decidedly faster than the
    reference, and the fastest such FP32-class one; where a class has none, the closest row to
    stay beside (``candidates`` sorted fastest first)."""
    faster = [r for r in candidates if decidedly_faster(r)]
    fp32_all = [r for r in candidates if r.parity_class == FP32_CLASS]
    fp32 = next((r for r in faster if r.parity_class == FP32_CLASS), None)
    best = faster[0] if faster else None
    floor = _score(best) if best is not None else 1.0
    passed_over = tuple((r.backend, why_not(r) if r not in candidates else
                         f"not decidedly faster than the reference (its interval "
                         f"[{_f(r.speedup_low, '.2f')}–{_f(r.speedup_high, '.2f')}] reaches 1.0)")
                        for r in others if r not in faster and _score(r) is not None and _score(r) > floor)
    common = dict(passed_over=passed_over, left_out=left_out, busy=busy, noisy=noisy)
    if best is None:
        return Recommendation(**base, stay=_choice(candidates[0], primary), **common)
    ties = [r.backend for r in faster[1:] if _overlap(best, r)]
    fp32_ties = [r.backend for r in faster if fp32 is not None and r is not fp32 and r.parity_class == FP32_CLASS
                 and _overlap(fp32, r)]
    fp32_stay = fp32_all[0] if fp32 is None and fp32_all and best.parity_class != FP32_CLASS else None
    return Recommendation(**base, best=_choice(best, primary, ties),
                          fp32=_choice(fp32, primary, fp32_ties) if fp32 is not None and fp32 is not best else None,
                          fp32_stay=_choice(fp32_stay, primary) if fp32_stay is not None else None, **common)


def for_run(results: Sequence, meta) -> Recommendation:
    """The recommendation of a run bundle's records (``RunMeta`` says the reference and metric).
    The run's problems that belong to one row ("<backend>: LoadGen Server INVALID ...") are that
    row's reason; the others (a reference that is not deterministic) hold back any recommendation."""
    primary = meta.primary_metric
    own = [p for p in (meta.problems or []) if not any(str(p).startswith(f"{r.backend}: ") for r in results)]
    return recommend(results, meta.reference, primary_metric=primary,
                     metric_label=(meta.metric_labels or {}).get(primary, primary), problems=own)


__all__ = ["Choice", "Recommendation", "decided_pass", "decidedly_faster", "for_run", "recommend", "why_not"]
