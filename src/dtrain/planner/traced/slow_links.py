"""How a data-parallel layout should synchronize over its links: every step in fp32, with
compressed gradients, or every H steps (local SGD, DiLoCo), by bytes, time and progress.

For a layout's dp axis, each option's bytes each rank sends per step (what
`dtrain.comm.traffic` counts) and its step time on the links (dtrain.planner.traced.links):

    every step       the gradients' all-reduce, 4 bytes per parameter, overlapping backward
    powersgd r       (m + n) r floats per m x n matrix instead of m n, in two all-reduces,
                     vectors whole; reduced after backward (no overlap)
    int8             1 byte per gradient element and a 4-byte scale per chunk, in an
                     all-to-all and an all-gather after backward
    local_sgd / diloco H
                     the parameters' all-reduce every H steps: 4/H bytes per parameter
                     per step; with streaming it overlaps the next inner steps

Fewer bytes are not the whole story: a method that synchronizes less also learns less per
step. `progress` is how many steps an option takes to reach the loss synchronous training
reaches in one, measured on dtrain's default job on emulated links (benchmarks/
slow_links.py; docs/slow-links.md has the table). The recommendation is the option with
the least `step_s * progress`: the time to reach the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.comm.ops import bus_factor
from dtrain.planner.costs import PARAM_BYTES
from dtrain.planner.traced.estimate import Estimate
from dtrain.planner.traced.links import Links
from dtrain.planner.traced.profile import Profile

POWERSGD_RANK = 4
INT8_CHUNK = 1024
SYNC_EVERY = (10, 50)
PROGRESS = {"every step": 1.0, "int8": 1.10, "powersgd": 1.25, "local_sgd 10": 1.17,
            "local_sgd 50": 1.04, "diloco 10": 2.0, "diloco 50": 1.52}
"""Steps to the loss one synchronous step reaches: the default job's held-out loss after
200 steps, reached by each option on 4 ranks as 2 sync groups (benchmarks/RESULTS.md,
"Training over slow links"; DiLoCo with the paper's outer lr 0.7 and momentum 0.9, H=10
not within 400 steps: 2 stands for it)."""


@dataclass
class SyncOption:
    """One way to synchronize the dp axis: its config, the bytes a rank sends and the
    seconds per step, and the steps it takes to a synchronous step's loss."""

    name: str
    config: dict[str, object]  # the config keys that choose it, as `--set` names them
    bytes_per_step: float
    step_s: float
    progress: float

    @property
    def time_to_loss_s(self) -> float:
        """Seconds to reach the loss one synchronous step reaches (step time x progress)."""
        return self.step_s * self.progress

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "config": self.config,
                "bytes_per_step": int(self.bytes_per_step), "step_s": self.step_s,
                "progress": self.progress, "time_to_loss_s": self.time_to_loss_s}


def powersgd_elements(profile: Profile, tp: int, rank: int = POWERSGD_RANK) -> float:
    """Floats PowerSGD all-reduces per step for the parameters a rank holds: (m + n) r per
    m x n matrix (dimension 0 by the rest; tp taken off m) where that is smaller, else
    the tensor whole."""
    total = 0.0
    for t in profile.tensors:
        if t.tied:
            continue
        count = profile.n_layer if t.part == "block" else 1
        numel = t.per_rank(tp)
        rows, cols = numel / t.row, t.row
        small = (rows + cols) * rank
        total += count * (small if cols > 1 and small < numel else numel)
    return total


def sync_options(profile: Profile, e: Estimate, links: Links) -> list[SyncOption]:
    """The options for `e`'s dp axis (none when dp = 1, under ZeRO, or with experts split
    over ep: dtrain compresses no such gradients), every-step first."""
    layout = e.dims
    if layout.dp == 1 or layout.zero or layout.exchange != "collective" or layout.ep > 1:
        return []
    grads = e.traffic.get("dp all_reduce", 0.0)  # buffer bytes of one step's gradients
    psi, n = grads / PARAM_BYTES, layout.dp
    backward_s = e.compute_s * 2 / 3 + e.recompute_s
    every = links.seconds({"dp all_reduce": grads}, {"dp all_reduce": 1.0}, layout)
    rest = e.step_s - max(0.0, every - backward_s)  # compute and the other axes' comm
    reduce_share, split_share = bus_factor("all_reduce", n), bus_factor("all_to_all", n)
    options = [SyncOption("every step", {"sync.method": "every_step"}, grads * reduce_share,
                          rest + max(0.0, every - backward_s), PROGRESS["every step"])]
    # the whole model's ratio, applied to what this rank holds (a pipeline stage's share)
    low = grads * powersgd_elements(profile, layout.tp) / profile.params.per_rank(layout.tp)
    options.append(SyncOption(
        f"powersgd r={POWERSGD_RANK}", {"comm.compression": "powersgd",
                                        "comm.compression_rank": POWERSGD_RANK},
        low * reduce_share,
        rest + links.seconds({"dp all_reduce": low}, {"dp all_reduce": 3.0}, layout),
        PROGRESS["powersgd"]))
    packed = psi * (1 + PARAM_BYTES / INT8_CHUNK)  # a byte per element, a scale per chunk
    options.append(SyncOption(
        "int8", {"comm.compression": "int8"}, 2 * packed * split_share,
        rest + links.seconds({"dp all_to_all": packed, "dp all_gather": packed},
                             {"dp all_to_all": 1.0, "dp all_gather": 1.0}, layout),
        PROGRESS["int8"]))
    for mode in ("local_sgd", "diloco"):
        for h in SYNC_EVERY:
            options.append(SyncOption(
                f"{mode} H={h}", {"sync.method": mode, "sync.every": h}, grads * reduce_share / h,
                rest + every / h, PROGRESS[f"{mode} {h}"]))
    return options


def recommend_sync(options: list[SyncOption]) -> tuple[SyncOption | None, str]:
    """The option reaching the same loss soonest, and why."""
    if not options:
        return None, "one data-parallel rank: nothing to synchronize"
    best = min(options, key=lambda o: o.time_to_loss_s)
    every = options[0]
    why = (f"{best.name}: {best.bytes_per_step / 2**20:.2f} MiB and "
           f"{best.step_s * 1e3:.1f} ms per step, {best.progress:g}x the steps, "
           f"{best.time_to_loss_s / every.time_to_loss_s:.2f}x every-step fp32's time to the "
           "same loss")
    return best, why
