"""GPU clusters described by numbers: accelerator presets, their links, and overrides.

    hw = hardware("a100-80gb")                                   # a preset
    hw = hardware("a100-80gb", {"inter_gbps": "50", "memory": "40GiB"})  # overridden
    hw = hardware("my-cluster.toml")                             # a file (see below)
    cluster = Cluster(hw, nodes=192, gpus_per_node=8)

A preset's figures are the vendor's datasheet numbers (dense bf16/fp16 tensor-core rate,
from `GPU_PEAKS`, which a training run's MFU divides by too (dtrain.train.hardware);
memory, memory bandwidth, NVLink bandwidth per direction; one InfiniBand/RoCE port per
GPU between nodes, as in DGX and HGX systems; the dense FP8 rate where the GPU has FP8
tensor cores, which `--precision fp8` plans with) and a few constants that say how much of
them software reaches. Those constants are documented in docs/choosing-a-layout.md:

- `gemm_efficiency`: the share of the peak rate a large bf16 matrix multiply reaches (the
  compute roof of dtrain.planner.analytic.cluster's roofline), the one fitted constant: 0.69, on
  two rows of Megatron-LM's published Table 1 on A100s (the first and the last), kept
  for the other presets;
- `memory_efficiency`: the share of memory bandwidth element-wise kernels and the
  optimizer step reach (0.8, what STREAM-like copies reach on HBM);
- `link_efficiency`: the share of a link's rate collectives reach (0.8, about what
  nccl-tests reports as bus bandwidth against the link rate);
- `intra_latency_us`, `inter_latency_us`: seconds per collective call inside a node and
  across nodes;
- `reserved`: memory a GPU cannot give the model (CUDA context, communication buffers,
  the allocator's fragmentation).

A TOML cluster file has one `[hardware]` table: `base = "h100-80gb"` (optional) and any
of the keys above, e.g. `inter_gbps = 25` or `memory = "40GB"`. `--set hardware.KEY=VALUE`
overrides a preset or a file the same way.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError
from dtrain.sizes import parse_size

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links around it (rates per GPU)."""

    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core rate
    memory: float  # bytes of device memory
    memory_gbps: float  # memory bandwidth, GB/s
    intra_gbps: float  # NVLink/NVSwitch, GB/s per direction
    inter_gbps: float  # InfiniBand/RoCE, GB/s per GPU per direction
    gpus_per_node: int = 8
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0
    link_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    gemm_efficiency: float = 0.69  # fitted: see the module doc
    reserved: float = 2 * GiB
    fp8_tflops: float = 0.0  # dense FP8 tensor-core rate; 0: the GPU has no FP8

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def fp8_flops(self) -> float:
        return self.fp8_tflops * 1e12

    def describe(self) -> str:
        fp8 = f" ({self.fp8_tflops:g} fp8)" if self.fp8_tflops else ""
        return (f"{self.name}: {self.peak_tflops:g} TFLOP/s bf16{fp8}, "
                f"{self.memory / GiB:.0f} GiB "
                f"at {self.memory_gbps / 1000:.2f} TB/s; NVLink {self.intra_gbps:g} GB/s, "
                f"network {self.inter_gbps:g} GB/s per GPU")


GPU_PEAKS: tuple[tuple[str, float], ...] = (
    # (a part of torch.cuda.get_device_name, dense bf16/fp16 tensor-core TFLOP/s), the
    # first match wins: a name that another contains comes after it.
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("A30", 165.0),
    ("V100", 125.0),  # fp16: a V100 has no bf16
    ("T4", 65.0),  # fp16
)
"""Datasheet peaks of NVIDIA's data-centre GPUs, dense (without 2:4 sparsity)."""


def gpu_peak(name: str) -> float:
    """The datasheet TFLOP/s of the GPU torch calls `name`; 0.0 for one not in GPU_PEAKS."""
    for part, tflops in GPU_PEAKS:
        if part.lower() in name.lower():
            return tflops
    return 0.0


PRESETS: dict[str, Hardware] = {
    # A100 SXM: 312 TFLOP/s bf16 (no FP8), NVLink 3 (600 GB/s both ways), HDR InfiniBand
    # 200 Gbit/s
    "a100-40gb": Hardware("a100-40gb", gpu_peak("A100"), 40 * GiB, 1555, 300, 25),
    "a100-80gb": Hardware("a100-80gb", gpu_peak("A100"), 80 * GiB, 2039, 300, 25),
    # H100 SXM5: 989 TFLOP/s bf16, 1979 fp8 (dense: the datasheet's 3958 is with sparsity),
    # NVLink 4 (900 GB/s both ways), NDR 400 Gbit/s
    "h100-80gb": Hardware("h100-80gb", gpu_peak("H100"), 80 * GiB, 3350, 450, 50, fp8_tflops=1979),
    # H200 SXM: an H100 with 141 GB of HBM3e at 4.8 TB/s
    "h200": Hardware("h200", gpu_peak("H200"), 141 * GiB, 4800, 450, 50, fp8_tflops=1979),
    # H800 SXM: an H100 whose NVLink carries 400 GB/s both ways (DeepSeek-V3's cluster,
    # one 400 Gbit/s InfiniBand port per GPU)
    "h800": Hardware("h800", gpu_peak("H800"), 80 * GiB, 3350, 200, 50, fp8_tflops=1979),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb",
           "h200-141gb": "h200"}
KEYS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name != "name")


def hardware(name: str, overrides: dict[str, str] | None = None) -> Hardware:
    """The preset `name` (or the TOML cluster file at that path), with `overrides`
    (key -> value as text) applied.

    Raises:
        ConfigError: an unknown preset, an unreadable file, an unknown key or a bad value.
    """
    key = ALIASES.get(name.lower(), name.lower())
    values: dict[str, str]
    if key in PRESETS:
        base, values = PRESETS[key], {}
    elif name.endswith(".toml"):
        base, values = _from_file(Path(name))
    else:
        raise ConfigError(f"--hardware {name!r} is unknown: use one of "
                          f"{', '.join(PRESETS)}, or a .toml cluster file")
    values.update(overrides or {})
    # _value refuses a key that is not one of Hardware's numeric fields
    return dataclasses.replace(base, **{k: _value(k, v)  # type: ignore[arg-type]
                                        for k, v in values.items()})


def _from_file(path: Path) -> tuple[Hardware, dict[str, str]]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--hardware {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--hardware {path}: not TOML ({exc})") from None
    table = data.get("hardware")
    if not isinstance(table, dict) or set(data) - {"hardware"}:
        raise ConfigError(f"--hardware {path}: give one [hardware] table (base = a preset, "
                          "and the keys to change)")
    table = dict(table)
    base_name = str(table.pop("base", "a100-80gb"))
    base = hardware(base_name)
    return dataclasses.replace(base, name=path.stem), {k: str(v) for k, v in table.items()}


def _value(key: str, text: str) -> float | int:
    if key not in KEYS:
        raise ConfigError(f"hardware.{key} is unknown: use one of {', '.join(KEYS)}")
    if key in ("memory", "reserved"):
        value: float = float(parse_size(text, f"hardware.{key}"))
    else:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"hardware.{key} = {text!r} is not a number") from None
    if key == "gpus_per_node":
        if value != int(value) or value < 1:
            raise ConfigError(f"hardware.gpus_per_node = {text} must be a positive whole "
                              "number")
        return int(value)
    lowest = 0.0 if key in ("reserved", "intra_latency_us", "inter_latency_us",
                            "fp8_tflops") else 1e-12
    if not lowest <= value < math.inf or (key.endswith("efficiency") and value > 1):
        raise ConfigError(f"hardware.{key} = {text} is out of range")
    return value


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `gpus_per_node` accelerators each."""

    hardware: Hardware
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError("--nodes and --gpus-per-node must be positive")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node
