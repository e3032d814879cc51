"""What the machine was doing while a backend was timed, and whether its time can be trusted.

A timing taken while other processes used the cores is not the backend's: PyTorch's OpenMP
threads spin at their barriers while a preempted sibling finishes, so sharing cores multiplies
time rather than adding to it. On a 2-core machine with another job running, the CPU eager-FP32
reference on 2 threads took 2.55 s for features it predicts in 0.054 s on 1 thread, and ONNX
Runtime came out "32.9x" faster; torch.compile's two passes were 54.6 and 126.2 s. Nothing in the
table said so. So each timed region records, from ``/proc`` and ``/sys``:

* the cores this process may use (``os.sched_getaffinity``, and a cgroup CPU quota when set) and
  the threads its runtime computes with (the thread plan of ``job_setup.load_job``; a backend's own option
  where it sets one);
* the CPU time every process took on those cores over the timed region (``/proc/stat``, per CPU)
  minus this process's own (``/proc/self/stat``): other processes' average demand, in cores;
  hypervisor steal time; the 1-minute load average at the end (``/proc/loadavg``: it lags, so it
  is reported, not judged);
* the CPU clock where readable (``cpufreq``, else ``/proc/cpuinfo``), and on CUDA the SM clock,
  its maximum, the throttle reasons and the other processes on the GPU (NVML, when ``nvidia-ml-py``
  is installed).

A row is **unreliable** when the timed threads and the other processes' demand together did not
fit the cores (threads + others > cores + ``SLACK_CORES``), when more than ``MAX_STEAL`` of the
time was stolen by the hypervisor, when the runtime had more threads than cores, or when the
GPU was slowed by something other than its normal power management or shared with another
process. ``SLACK_CORES`` (0.15 of a core) is the background a quiet machine keeps (daemons, this
bench's own parent and log pump: measured 0.01-0.05 here); a job that shares the cores for a
tenth of the timed region already costs the spinning threads far more than its share.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from ..record.noise import BENIGN_GPU_REASONS, GPU_REASON_NAMES
from .interrupt import PARENT_ENV

SLACK_CORES = 0.15
MAX_STEAL = 0.05
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# NVML throttle / clock-event reasons, and those that are normal operation (record/noise.py)
_BENIGN_GPU_REASONS, _GPU_REASON_NAMES = BENIGN_GPU_REASONS, GPU_REASON_NAMES


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota if one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota_cores()
    return max(1, min(n, int(quota)) if quota else n)


def _cgroup_quota_cores() -> Optional[float]:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        q, p = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if q != "max":
            return max(1.0, int(q) / int(p))
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if q > 0 and p > 0:
            return max(1.0, q / p)
    except (OSError, ValueError):
        pass
    return None


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _proc_stat(cpus: list[int]) -> Optional[tuple[float, float]]:
    """(busy, steal) seconds summed over ``cpus`` since boot, from /proc/stat."""
    want = {f"cpu{i}" for i in cpus}
    busy = steal = 0.0
    found = False
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] in want:
                v = [int(x) for x in parts[1:]]
                # user nice system idle iowait irq softirq steal (guest time is inside user)
                busy += sum(v[:3]) + sum(v[5:7])
                steal += v[7] if len(v) > 7 else 0
                found = True
    except (OSError, ValueError):
        return None
    return (busy / _CLK_TCK, steal / _CLK_TCK) if found else None


def _self_cpu() -> Optional[float]:
    """This process's CPU seconds (every thread), from /proc/self/stat."""
    try:
        text = Path("/proc/self/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _loadavg() -> Optional[float]:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_mhz(cpus: list[int]) -> list[float]:
    out = []
    for i in cpus:
        try:
            out.append(int(Path(f"/sys/devices/system/cpu/cpu{i}/cpufreq/scaling_cur_freq").read_text()) / 1000.0)
        except (OSError, ValueError):
            pass
    if out:
        return out
    try:  # no cpufreq (many VMs): the kernel's view in /proc/cpuinfo
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        return [mhz[i] for i in cpus if i < len(mhz)] or mhz
    except (OSError, ValueError, IndexError):
        return []


def process_threads() -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class MachineState:
    """Brackets one timed region: ``start()`` before the first timed pass, ``stop()`` after the
    last; ``values`` then holds the BackendResult fields (``other_cpu_cores``, ``timing_note``...)."""

    def __init__(self, threads: Optional[int], cuda: bool = False, nvml=None, handle=None):
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads
        self.cuda = cuda
        self._nvml, self._handle = nvml, handle
        self.cpus = _cpus()
        self.cores = usable_cores()
        self.values: dict = {}
        self._t0 = self._stat0 = self._self0 = None
        self._busy = self._steal = self._own = self._wall = 0.0
        self._complete = True
        self._mhz: list[float] = []
        # NVML samples over the timed passes (measuring/gpu_sensor.GpuSampler, summarised by
        # record/noise.gpu_samples_summary): they replace the one reading stop() takes, when the
        # card is already idle (an H200 at its power cap read 1,980 MHz there, 1,650 under load)
        self.gpu_summary: dict = {}

    def start(self) -> None:
        self._mhz = _cpu_mhz(self.cpus)
        self._busy = self._steal = self._own = self._wall = 0.0
        self._complete = True
        self.resume()

    def resume(self) -> None:
        """Start (again) counting: interleaved rounds time a row pass by pass, and what the other
        rows' processes do between its passes is not its machine's state."""
        self._stat0, self._self0, self._t0 = _proc_stat(self.cpus), _self_cpu(), time.monotonic()

    def pause(self) -> None:
        """Stop counting until the next ``resume``; the lap's counts are added up."""
        if self._t0 is None:
            return
        stat1, self1 = _proc_stat(self.cpus), _self_cpu()
        self._wall += time.monotonic() - self._t0
        if self._stat0 and stat1 and self._self0 is not None and self1 is not None:
            self._busy += stat1[0] - self._stat0[0]
            self._steal += stat1[1] - self._stat0[1]
            self._own += self1 - self._self0
        else:
            self._complete = False
        self._t0 = None

    def stop(self) -> dict:
        self.pause()
        wall = self._wall
        v: dict = {"threads": self.threads, "usable_cores": self.cores, "load_avg_1m": _loadavg()}
        if wall > 0 and self._complete:
            # clock ticks are 10 ms: a short region's estimate is rounded, never below zero
            v["other_cpu_cores"] = max(0.0, (self._busy - self._own) / wall)
            v["cpu_steal_pct"] = 100.0 * max(0.0, self._steal) / (wall * max(1, len(self.cpus)))
            v["timed_wall_s"] = wall
        mhz = self._mhz + _cpu_mhz(self.cpus)
        if mhz:
            v["cpu_mhz_min"], v["cpu_mhz_max"] = min(mhz), max(mhz)
        if self.cuda and self._handle is not None:
            v.update(gpu_state(self._nvml, self._handle))
        v.update(self.gpu_summary)
        # a GPU row's host side feeds the device from one thread; a CPU row computes on all of its
        v["timing_reliable"], v["timing_note"] = judge(v, demand=1 if self.cuda else self.threads)
        self.values = v
        return v


def gpu_state(nvml, handle) -> dict:
    """SM clock against its maximum, the throttle reasons that were active, other processes on the GPU."""
    out: dict = {}
    try:
        out["gpu_sm_clock_mhz"] = float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        out["gpu_sm_clock_max_mhz"] = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001 - a GPU without the query: the rest still counts
        pass
    try:
        get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = int(get(handle))
        bad = [name for bit, name in _GPU_REASON_NAMES.items() if mask & bit and bit not in _BENIGN_GPU_REASONS]
        out["gpu_throttle"] = ", ".join(bad)
    except Exception:  # noqa: BLE001
        pass
    try:
        pids = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        others = sorted(p for p in pids - {os.getpid()} if not same_run(p))
        out["gpu_other_processes"] = len(others)
    except Exception:  # noqa: BLE001
        pass
    return out


def _ppid(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def same_run(pid: int, depth: int = 6) -> bool:
    """The process is another of this run's own, idle while this row is timed, so not another
    user of the GPU: the bench that launched this worker (``BERTQA_PARENT_PID`` names it; it waits
    for the row's reply, and holds a CUDA context when it trained the model in the same run) or a
    process descended from it, such as another row's worker waiting for its turn in the rounds
    with its CUDA context open, or a compile worker. A process the launcher did not start (in
    process, or by hand) counts only its own descendants: whatever started it may be using the GPU."""
    root = bench_pid()
    if pid == root:
        return True
    for _ in range(depth):
        pid = _ppid(pid)
        if pid is None or pid <= 0:
            return False
        if pid == root:
            return True
    return False


def bench_pid() -> int:
    """The bench this worker belongs to: its parent when the launcher started it, else itself."""
    parent, named = os.getppid(), os.environ.get(PARENT_ENV, "")
    return parent if named.isdigit() and int(named) == parent else os.getpid()


def judge(v: dict, demand: Optional[int] = None) -> tuple[Optional[bool], str]:
    """(reliable, note) of one timed region's machine state (the rules in the module docstring);
    ``demand``: the cores the timed work itself keeps busy (its threads on a CPU, 1 for a GPU
    row's host thread). None when nothing could be read (then nothing is claimed either way)."""
    other, threads, cores = v.get("other_cpu_cores"), v.get("threads"), v.get("usable_cores")
    demand = demand if demand is not None else (threads or 1)
    if other is None and not v.get("gpu_throttle") and not v.get("gpu_other_processes"):
        return None, ""
    why = []
    load = v.get("load_avg_1m")
    load_txt = f", load {load:.1f}" if load is not None else ""
    if threads and cores and threads > cores and demand > 1:
        why.append(f"{threads} threads on {cores} cores")
    if other is not None and cores and other > cores - min(demand, cores) + SLACK_CORES:
        why.append(f"other processes used {other:.1f} of the {cores} cores{load_txt}")
    steal = v.get("cpu_steal_pct")
    if steal is not None and steal > 100 * MAX_STEAL:
        why.append(f"{steal:.0f}% CPU time stolen by the hypervisor")
    if v.get("gpu_throttle"):
        why.append(f"GPU clocks held down ({v['gpu_throttle']})")
    if v.get("gpu_other_processes"):
        why.append(f"{v['gpu_other_processes']} other process(es) on the GPU")
    if why:
        return False, "unreliable (" + "; ".join(why) + ")"
    return True, ""


def runtime_threads(prepare_info: dict) -> int:
    """The threads a backend computes with: its own setting where prepare reported one (ONNX
    Runtime's intra-op pool, OpenVINO's, a torch variant's), else torch's thread count."""
    for key in ("intra_op_num_threads", "num_threads", "threads"):
        v = (prepare_info or {}).get(key)
        if isinstance(v, int) and v > 0:
            return v
    import torch

    return torch.get_num_threads()
