"""What one rank's hardware can do, for MFU: its peak dense rate, and its peak memory.

    peak = peak_of(0.0, torch.device("cuda", 0))   # 989 TFLOP/s on an H100 SXM
    peak.tflops, peak.source                       # (989.0, "datasheet, NVIDIA H100 80GB HBM3")
    peak_memory_bytes(device)                      # the most this process has held

The peak is, in order: `[logging] peak_tflops` when it is set; on a GPU, the dense
bf16/fp16 tensor-core rate of its datasheet, found by the name torch gives the device
(`GPU_PEAKS` in dtrain/planner/analytic/hardware.py, which the planner's presets read too);
on a CPU, a calibration at start: the best of a few fp32 matrix products of
1024 x 1024, a fraction of a second, cached in ~/.cache/dtrain/cpu_peak.json by the CPU's
model name and torch's thread count so a second run does not measure again. A GPU not in
the table has no peak (no MFU is reported; the run says to set `peak_tflops`).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrain.planner.analytic.hardware import gpu_peak

CALIBRATION_SIZE = 1024
CALIBRATION_REPEATS = 20  # best of: one product undisturbed by the other ranks is enough


@dataclass(frozen=True)
class Peak:
    """A rank's peak dense rate: `tflops` (0.0 when unknown) and where it came from."""

    tflops: float
    source: str

    @property
    def known(self) -> bool:
        return self.tflops > 0


def peak_of(configured: float, device: torch.device) -> Peak:
    """The peak that MFU divides by, for a rank computing on `device`: `configured` when
    positive, else the GPU's datasheet figure or the CPU's calibrated one."""
    if configured > 0:
        return Peak(configured, "[logging] peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = gpu_peak(name)
        return Peak(tflops, f"datasheet, {name}" if tflops else
                    f"{name} is not in dtrain's table: set [logging] peak_tflops")
    return Peak(cpu_peak(), f"calibrated, {cpu_name()} with {torch.get_num_threads()} "
                "thread(s)")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), or what platform knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cache_path() -> Path:
    """Where calibrated CPU peaks are kept: $XDG_CACHE_HOME/dtrain, or ~/.cache/dtrain."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtrain" / "cpu_peak.json"


def cpu_peak() -> float:
    """This CPU's fp32 matrix-product rate in TFLOP/s with torch's threads: cached, or
    calibrated now and cached (a cache that cannot be read or written is measured anew)."""
    key = f"{cpu_name()} | {torch.get_num_threads()} threads"
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), float | int):
        return float(cached[key])
    tflops = calibrate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs at once: either one's
        tmp.write_text(json.dumps({**(cached if isinstance(cached, dict) else {}),
                                   key: tflops}, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return tflops


def calibrate(size: int = CALIBRATION_SIZE, repeats: int = CALIBRATION_REPEATS) -> float:
    """The best rate of `repeats` fp32 products of two `size` x `size` matrices, TFLOP/s
    (2·size³ FLOPs each); one product first, untimed, to warm the kernels."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - begin)
    return 2.0 * size**3 / best / 1e12


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this rank has held: on a GPU the most torch has allocated on
    `device`; on a CPU the process's peak resident set (the whole process's, which also
    holds Python, torch and the data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB on Linux
