"""Which noise sensor speaks for which row, and what the GPU did while a row was timed.

Two sensors are read each round of the interleaved rounds (measuring/rounds.py):

* the **host calibration**: a fixed numpy workload on one CPU thread in the idle parent. Its
  spread over rounds is how much the host's speed wandered. A CPU row computes on the host, so
  the whole spread reaches it.
* the **GPU sensor** (measuring/gpu_sensor.py): a fixed CUDA workload (GEMMs and a
  device-to-device copy) timed by CUDA events, one event pair a repetition, and NVML's count of
  other processes on the card. Its spread over rounds is how much the GPU's speed wandered (a
  clock that moved); the spread of its repetitions within a round is contention: another
  process's kernels time-sliced in between ours stretch some repetitions and not others; a
  quiet card repeats a GEMM to within a few percent.

A GPU pass barely touches the host (two benches on one H200: calibration spread 10-15 % while the
GPU rows' passes spread 0.1-0.5 %), so a GPU row is judged by the GPU sensor, and by the host
calibration only in proportion to the share of its passes the GPU sat idle (NVML's utilization
over the row's own passes: the host's own work, such as packing batches, is then on the critical
path): a row whose passes are a share h of host work moves by about h times the host's spread.
A CPU row's share is 1. Pure functions; the readings come from measuring/.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence


def spread_pct(values: Sequence[Optional[float]]) -> Optional[float]:
    """Coefficient of variation in percent (standard deviation over mean); None under two values.
    Here rather than in record/rounds.py, which loads scipy: the report views import this module."""
    vals = [float(v) for v in values if v is not None]
    if len(vals) < 2 or statistics.fmean(vals) <= 0:
        return None
    return 100.0 * statistics.stdev(vals) / statistics.fmean(vals)


# NVML throttle / clock-event reasons (nvmlClocksEventReasons): bit -> name
GPU_REASON_NAMES = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
                    0x10: "sync boost", 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake",
                    0x100: "display clocks"}
# normal operation, not a slower measurement of the same card: idle, the application clock
# setting, the software power cap under load (reported as gpu_power_capped, not as a throttle)
BENIGN_GPU_REASONS = {0x1, 0x2, 0x4}
POWER_CAP = 0x4
# a reason counts for a row when it was active in at least this share of the samples over its
# passes: one sample at a clock change is not the row's state
REASON_SHARE = 0.5


def sensor_round(gemm_ms: Sequence[float], copy_ms: Sequence[float], other_processes: Optional[int] = None) -> dict:
    """One round's GPU sensor reading from its repetitions (milliseconds each, CUDA events):
    the total, the median GEMM and copy, and the spread of the repetitions within the round
    (the larger of the GEMMs' and the copies' coefficient of variation, in percent)."""
    if not gemm_ms or any(t is None or t <= 0 for t in [*gemm_ms, *copy_ms]):
        raise ValueError(f"GPU sensor: every repetition needs a positive time, got gemm {list(gemm_ms)} "
                         f"copy {list(copy_ms)}")
    jitter = [v for v in (spread_pct(gemm_ms), spread_pct(copy_ms)) if v is not None]
    # the repetitions themselves too: on a quiet H200 they spread 7.5-9.7 % within a round, close to
    # the 10 % threshold, and which of them are slow (the first, as the clock settles, or any) says
    # whether the warm-up or the measure should change
    return {"total_ms": float(sum(gemm_ms) + sum(copy_ms)), "gemm_ms": float(statistics.median(gemm_ms)),
            "copy_ms": float(statistics.median(copy_ms)) if copy_ms else None,
            "jitter_pct": max(jitter) if jitter else None, "other_processes": other_processes,
            "gemm_reps_ms": [round(float(t), 4) for t in gemm_ms], "copy_reps_ms": [round(float(t), 4) for t in copy_ms]}


@dataclass(frozen=True)
class GpuNoise:
    """The GPU sensor over a run's rounds."""

    spread_pct: Optional[float]  # coefficient of variation of the rounds' totals
    jitter_pct: Optional[float]  # the median round's spread of its repetitions
    other_processes: int  # the most other processes NVML saw on the card in a round
    rounds: int

    def noisy(self, threshold_pct: float) -> Optional[bool]:
        if self.spread_pct is None and self.jitter_pct is None and not self.other_processes:
            return None
        return bool(self.why(threshold_pct))

    def why(self, threshold_pct: float) -> str:
        parts = []
        if self.spread_pct is not None and self.spread_pct > threshold_pct:
            parts.append(f"its time spread {self.spread_pct:.1f}% over {self.rounds} rounds")
        if self.jitter_pct is not None and self.jitter_pct > threshold_pct:
            parts.append(f"its repetitions spread {self.jitter_pct:.1f}% within a round (another process's kernels)")
        if self.other_processes:
            parts.append(f"{self.other_processes} other process(es) on the GPU")
        return "; ".join(parts)


def gpu_sensor_noise(readings: Sequence[Optional[dict]]) -> Optional[GpuNoise]:
    """The run's GPU noise from each round's ``sensor_round`` (None where a round had none)."""
    rs = [r for r in readings if r]
    if not rs:
        return None
    jitters = [r["jitter_pct"] for r in rs if r.get("jitter_pct") is not None]
    return GpuNoise(spread_pct=spread_pct([r["total_ms"] for r in rs]),
                    jitter_pct=float(statistics.median(jitters)) if jitters else None,
                    other_processes=max((r.get("other_processes") or 0 for r in rs), default=0), rounds=len(rs))


def gpu_samples_summary(samples: Sequence[tuple]) -> dict:
    """NVML samples taken over a row's own passes, each (SM clock MHz, power W, reason mask,
    utilization %; any may be None), into the row's fields: the median SM clock and power, the
    median utilization (``gpu_busy_pct``), whether the software power cap held the clock down
    for most of the passes, and the other reasons active as often (``gpu_throttle``)."""
    if not samples:
        return {}

    def med(i):
        vals = [s[i] for s in samples if s[i] is not None]
        return float(statistics.median(vals)) if vals else None

    masks = [int(s[2]) for s in samples if s[2] is not None]
    out = {"gpu_sm_clock_mhz": med(0), "gpu_power_w": med(1), "gpu_busy_pct": med(3), "gpu_samples": len(samples)}
    if masks:
        def often(bit):
            return sum(1 for m in masks if m & bit) >= REASON_SHARE * len(masks)

        out["gpu_power_capped"] = often(POWER_CAP)
        out["gpu_throttle"] = ", ".join(name for bit, name in GPU_REASON_NAMES.items()
                                        if bit not in BENIGN_GPU_REASONS and often(bit))
    return {k: v for k, v in out.items() if v is not None}


def host_share(device: str, gpu_busy_pct: Optional[float]) -> Optional[float]:
    """The share of a row's pass the host's own speed is on the critical path of: 1 on a CPU;
    on a GPU the share of its passes the GPU was idle (None when NVML did not say)."""
    if device != "cuda":
        return 1.0
    if gpu_busy_pct is None:
        return None
    return min(1.0, max(0.0, 1.0 - gpu_busy_pct / 100.0))


def row_noise(device: str, *, calibration_cv_pct: Optional[float], gpu_busy_pct: Optional[float],
              gpu: Optional[GpuNoise], threshold_pct: float) -> tuple[Optional[bool], str]:
    """(noisy, why) for one row: a CPU row by the host calibration; a GPU row by the GPU sensor,
    and by the host calibration scaled by its host share (``host_share``). None when no sensor
    that speaks for the row was read."""
    why, read = [], False
    share = host_share(device, gpu_busy_pct)
    if calibration_cv_pct is not None and share is not None:
        read = True
        felt = share * calibration_cv_pct
        if felt > threshold_pct:
            why.append(f"host calibration spread {calibration_cv_pct:.1f}%" + (
                f", {100 * share:.0f}% of its passes host-bound" if device == "cuda" else ""))
    if device == "cuda" and gpu is not None:
        read = True
        if gpu.noisy(threshold_pct):
            why.append(f"GPU sensor: {gpu.why(threshold_pct)}")
    if not read:
        return None, ""
    return bool(why), "; ".join(why)


def gpu_clock_text(r) -> str:
    """'power-capped at 1,650 MHz, 692 W' (a row's median SM clock and power over its passes)."""
    if getattr(r, "gpu_sm_clock_mhz", None) is None:
        return ""
    text = ("power-capped at " if r.gpu_power_capped else "") + f"{r.gpu_sm_clock_mhz:,.0f} MHz"
    if getattr(r, "gpu_power_w", None) is not None:
        text += f", {r.gpu_power_w:,.0f} W"
    return text


__all__ = ["BENIGN_GPU_REASONS", "GPU_REASON_NAMES", "GpuNoise", "gpu_clock_text", "gpu_samples_summary",
           "gpu_sensor_noise", "host_share", "row_noise", "sensor_round", "spread_pct"]
