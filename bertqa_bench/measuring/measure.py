"""What a backend's process costs beside time: peak memory and, on GPUs, energy.

* Host: the kernel's peak resident set (VmHWM in /proc/self/status), reset between phases by
  writing 5 to /proc/self/clear_refs, so prepare and prediction each get their own peak.
* CUDA: PyTorch's allocator peaks (allocated / reserved; reset between phases) and the
  device's used memory from NVML (``nvidia-ml-py``, imported only if installed). Allocations
  outside PyTorch's allocator (ONNX Runtime's arena, TensorRT) show up only in NVML's number.
* Energy: NVML's total-energy counter (millijoules since the driver loaded) read before and
  after the timed passes — a measurement, on GPUs that have the counter. On a CPU no energy
  is reported unless a RAPL counter is readable (/sys/class/powercap), and then it is the
  package energy of the whole socket, said so in the note.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from ..envinfo import cuda_visible_devices
from ..record.noise import gpu_samples_summary
from .gpu_sensor import GpuSampler
from .machine_state import MachineState

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")
_RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")


def _status_kb(field: str) -> Optional[int]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def host_peak_mib() -> Optional[float]:
    kb = _status_kb("VmHWM")  # the kernel's "kB" are KiB: / 1024 gives MiB
    return None if kb is None else kb / 1024.0


def reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible here."""
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def _nvml_handle():
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        import torch

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        # NVML counts every GPU of the host; torch only those in CUDA_VISIBLE_DEVICES (a
        # data-parallel worker sees its one GPU as device 0): map torch's index to the host's.
        visible = cuda_visible_devices()
        if visible and all(v.isdigit() for v in visible):
            index = int(visible[index])
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML here: the other numbers still count
        return None, None


class Probe:
    """Memory peaks per phase and energy over the timed region of one backend's process."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.values: dict = {}
        self._nvml, self._handle = _nvml_handle() if cuda else (None, None)
        self._energy0: Optional[int] = None
        self._rapl0: Optional[int] = None

    def _cuda_peaks(self, phase: str) -> None:
        import torch

        torch.cuda.synchronize()
        self.values[f"{phase}_cuda_allocated_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        self.values[f"{phase}_cuda_reserved_peak_mib"] = torch.cuda.max_memory_reserved() / 2**20
        torch.cuda.reset_peak_memory_stats()
        if self._handle is not None:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            self.values[f"{phase}_device_used_mib"] = info.used / 2**20

    def end_phase(self, phase: str) -> None:
        """Record the peaks of the phase that just ended and start the next one from now."""
        peak = host_peak_mib()
        if peak is not None:
            self.values[f"{phase}_host_peak_mib"] = peak
        reset_host_peak()
        if self.cuda:
            self._cuda_peaks(phase)

    def start_timed(self, threads: Optional[int] = None) -> None:
        """Before the first timed pass: energy counters, and the machine's state (machine_state.py)."""
        self._machine = MachineState(threads, cuda=self.cuda, nvml=self._nvml, handle=self._handle)
        # the GPU's clock, power and utilization over the timed passes only (gpu_sensor.py)
        self._sampler = GpuSampler(self._nvml, self._handle) if self._handle is not None else None
        self._machine.start()
        if self._sampler is not None:
            self._sampler.start()
        self._energy_sum, self._rapl_sum = 0.0, 0.0
        self._energy_ok = self._rapl_ok = True
        self._read_energy()

    def _read_energy(self) -> None:
        self._energy0 = self._rapl0 = None
        if self._handle is not None:
            try:
                self._energy0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            except Exception:  # noqa: BLE001 - older GPUs have no energy counter
                self._energy_ok = False
        elif not self.cuda and _RAPL.exists():
            try:
                self._rapl0 = int(_RAPL.read_text())
            except (OSError, ValueError):
                self._rapl_ok = False
        else:
            self._rapl_ok = False

    def pause_timed(self) -> None:
        """Between two passes of interleaved rounds: what follows until ``resume_timed`` (other
        rows' passes) is not this row's energy or machine state."""
        if getattr(self, "_machine", None) is None:
            return
        if self._sampler is not None:
            self._sampler.stop()
        self._machine.pause()
        if self._energy0 is not None:
            self._energy_sum += (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._energy0) / 1000.0
        elif self._rapl0 is not None:
            try:
                end = int(_RAPL.read_text())
                if end >= self._rapl0:
                    self._rapl_sum += (end - self._rapl0) / 1e6
                else:  # the counter wrapped: this lap cannot be counted
                    self._rapl_ok = False
            except (OSError, ValueError):
                self._rapl_ok = False
        self._energy0 = self._rapl0 = None

    def resume_timed(self) -> None:
        if getattr(self, "_machine", None) is None:
            return
        self._machine.resume()
        self._read_energy()
        if self._sampler is not None:
            self._sampler.start()

    def end_timed(self, seconds: float, n_rows: int) -> None:
        if getattr(self, "_machine", None) is None:
            return
        self.pause_timed()
        if self._sampler is not None:
            self._machine.gpu_summary = gpu_samples_summary(self._sampler.samples)
        self.values.update(self._machine.stop())
        joules, note = None, ""
        if self._handle is not None and self._energy_ok:
            joules, note = self._energy_sum, "NVML total-energy counter of the GPU"
        elif not self.cuda and self._rapl_ok:
            joules, note = self._rapl_sum, "RAPL package counter (whole CPU socket, other processes included)"
        if joules is None:
            why = ("no NVML (pip install nvidia-ml-py) or no energy counter on this GPU" if self.cuda
                   else "no readable RAPL counter on this CPU")
            self.values["energy_note"] = f"not measured: {why}"
            return
        self.values.update(energy_j=joules, energy_j_per_1k_features=joules / max(n_rows, 1) * 1000.0,
                           avg_power_w=joules / seconds if seconds > 0 else None, energy_note=note)


class UtilizationSampler:
    """The GPU's utilization (NVML's share of time a kernel ran) sampled twice a second in a
    thread, for training's metrics; a no-op without a GPU or NVML."""

    def __init__(self, device, every_s: float = 0.5):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._nvml, self._handle = (None, None)
        if getattr(device, "type", "cpu") == "cuda":
            self._nvml, self._handle = _nvml_handle()
        if self._handle is None:
            return

        def run():
            while not self._stop.wait(every_s):
                try:
                    self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
                except Exception:  # noqa: BLE001 - a missed sample is not worth a training
                    pass

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def stop(self) -> dict:
        self._stop.set()
        if self._handle is None:
            return {}  # no GPU or no NVML: nothing measured, nothing claimed
        mean = sum(self.samples) / len(self.samples) if self.samples else None
        return {"gpu_utilization_mean_pct": mean, "gpu_utilization_samples": len(self.samples)}
