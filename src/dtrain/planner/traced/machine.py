"""This machine's figures for the planner: memory per device, the matrix-multiply rate,
and the links between ranks (what `dtrain bench comm --calibrate` measured, else assumed).
`dtrain plan` uses them when not told otherwise, and so does an elastic job choosing the
layout of a new round (dtrain.ft.elastic)."""

from __future__ import annotations

import os
import time

import torch

from dtrain.comm.select import calibration_path
from dtrain.planner.traced.links import DEFAULT_GBPS, DEFAULT_LATENCY_US, Links


def device_memory(devices: int) -> tuple[float, str]:
    """Bytes one of `devices` ranks on this machine may use, and where the figure is from:
    the GPU's memory, else the RAM shared by the ranks."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "this machine's GPU"
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages / devices, f"this machine's RAM / {devices}"


def measured_flops(seconds: float = 0.3) -> float:
    """FLOP/s of a 512x512 float32 matrix multiply on this machine (one process)."""
    a = torch.randn(512, 512)
    a @ a
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    return 2 * 512**3 * count / (time.perf_counter() - start)


def links() -> Links:
    """The links the calibration file describes, else the defaults (and says so)."""
    measured = Links.calibrated(str(calibration_path()))
    if measured is not None:
        return measured
    assumed = Links.given(DEFAULT_GBPS, DEFAULT_LATENCY_US)
    assumed.source = (f"assumed {DEFAULT_GBPS:g} GB/s and {DEFAULT_LATENCY_US:g} us per call "
                      "(measure them: dtrain bench comm --calibrate, or give --bandwidth)")
    return assumed
