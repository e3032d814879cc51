"""The GPU's side of the noise sensors: small on purpose (the decisions are record/noise.py's).

* ``GpuSensor``: the fixed CUDA workload the parent times at the start of each round, beside the
  host calibration: ``gemm_reps`` fp16 GEMMs of ``gemm_n``^3, then ``copy_reps`` device-to-device
  copies of ``copy_mib`` MiB, each repetition between two CUDA events (about 50 ms on an H200 at
  the defaults: a GEMM ~1.8 ms, a copy ~0.35 ms), and NVML's count of other processes on the
  card. It runs between the rows' passes, never during one, like the calibration.
* ``GpuSampler``: a thread in a GPU row's worker reading NVML's SM clock, power, clock-event
  reasons and utilization every ``every_s`` over the row's own passes (paused while the other
  rows are timed), so the row's record carries its clock under load, not one reading taken when
  the card had already gone idle.

Both need CUDA; NVML (``pip install nvidia-ml-py``) is optional: without it the sensor times its
workload all the same and the sampler reads nothing.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from ..envinfo import cuda_visible_devices
from ..record.noise import sensor_round
from .machine_state import same_run

NVML_HINT = "pip install nvidia-ml-py (NVML: the GPU's clocks, power and processes)"


def nvml():
    """The initialised ``pynvml`` module, or None where it is not installed or has no driver."""
    try:
        import pynvml
    except ImportError:  # optional: NVML_HINT says what to install
        return None
    try:
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no driver or no GPU: nothing read, nothing claimed
        return None


def nvml_handle(nvml_mod, device: int):
    """NVML's handle of CUDA device ``device``: NVML counts the host's GPUs, CUDA the visible ones."""
    visible = cuda_visible_devices()
    index = int(visible[device]) if visible and all(v.isdigit() for v in visible) else device
    return nvml_mod.nvmlDeviceGetHandleByIndex(index)


def other_gpu_processes(nvml_mod, handle) -> Optional[int]:
    """Processes on the card that are not this run's (machine_state.same_run): None if unreadable."""
    try:
        pids = {p.pid for p in nvml_mod.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:  # noqa: BLE001
        return None
    return len([p for p in pids - {os.getpid()} if not same_run(p)])


class GpuSensor:
    """Callable: one round's reading (record/noise.sensor_round) of the fixed CUDA workload."""

    def __init__(self, device: int = 0, gemm_n: int = 8192, gemm_reps: int = 20, copy_mib: int = 512,
                 copy_reps: int = 20):
        self.device, self.gemm_n, self.gemm_reps = device, gemm_n, gemm_reps
        self.copy_mib, self.copy_reps = copy_mib, copy_reps
        self._nvml = nvml()
        self._handle = nvml_handle(self._nvml, device) if self._nvml is not None else None

    def __call__(self) -> dict:
        import torch  # the parent of a GPU bench; slow to import, so only here

        dev = torch.device("cuda", self.device)
        a = torch.randn(self.gemm_n, self.gemm_n, device=dev, dtype=torch.float16)
        b, c = torch.randn_like(a), torch.empty_like(a)
        src = torch.empty(self.copy_mib << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        torch.mm(a, b, out=c)  # first call: cuBLAS picks its kernel outside the timed repetitions
        dst.copy_(src)
        gemm = self._timed(torch, lambda: torch.mm(a, b, out=c), self.gemm_reps)
        copy = self._timed(torch, lambda: dst.copy_(src), self.copy_reps)
        del a, b, c, src, dst
        torch.cuda.empty_cache()  # the rows' processes need the card's memory, not this one
        others = other_gpu_processes(self._nvml, self._handle) if self._handle is not None else None
        return sensor_round(gemm, copy, others)

    @staticmethod
    def _timed(torch, work, reps: int) -> list:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        events[0].record()
        for i in range(reps):
            work()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) for i in range(reps)]


class GpuSampler:
    """NVML samples (SM clock MHz, power W, reason mask, utilization %) while started."""

    def __init__(self, nvml_mod, handle, every_s: float = 0.02):
        self._nvml, self._handle, self.every_s = nvml_mod, handle, every_s
        self.samples: list[tuple] = []
        self._kept = 0  # samples up to the last stop: the timed ones
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> tuple:
        n, h = self._nvml, self._handle

        def read(f):
            try:
                return f()
            except Exception:  # noqa: BLE001 - a query this GPU lacks: that value stays None
                return None

        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        power_mw = read(lambda: n.nvmlDeviceGetPowerUsage(h))
        return (read(lambda: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
                None if power_mw is None else power_mw / 1000.0, read(lambda: int(reasons(h))),
                read(lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu)))

    def start(self) -> None:
        """Sample from now. Started again while running (rounds: the first pass's ``resume`` after
        ``start_timed``), the samples since the last stop are dropped, as MachineState.resume drops
        its counts: the row's worker was waiting for its turn, idle, while the others were timed."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            del self.samples[self._kept:]
        self._stop.clear()

        def run():
            while True:
                self.samples.append(self.sample())
                if self._stop.wait(self.every_s):
                    return

        self._thread = threading.Thread(target=run, daemon=True, name="gpu-sampler")
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._kept = len(self.samples)
