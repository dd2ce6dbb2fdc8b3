"""What recording a timeline costs: 4-KiB all_reduces with the timeline off and on, side by
side in one run, and the cost of the check every hook makes when it is off.

    dtrain run -n 2 benchmarks/timeline_overhead.py [--rounds 21 --calls 2000]

Off and on take turns in rounds (order flipped every round): off is a run without
`--timeline` (no recorder: each hook is one `recorder() is None` check), on records every
call (a span per all_reduce, written out after the round, outside the timing). The figures
are the median over rounds of the time per call, the slowest rank's. The off check and
the recording of one span are also timed alone, against the time of one call (on a busy
machine they are the steadier figures: the rounds' difference is within their noise).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit

import torch

import dtrain
from dtrain import comm
from dtrain import world as world_mod
from dtrain.timeline import Recorder


def per_call(t: torch.Tensor, calls: int) -> float:
    """Seconds per all_reduce of `t`, over `calls` back to back after a barrier."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(t, algorithm="native")
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=4, help="message size in KiB")
    args = parser.parse_args()
    world = dtrain.init()
    t = torch.ones(args.kib * 256)
    per_call(t, 200)  # warm-up
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if mode == "on":
                    dtrain.init(timeline=f"{folder}/t.json")
                times[mode].append(per_call(t, args.calls))
                world_mod.close_timeline()  # writes this round's spans, outside the timing
    medians = torch.tensor([statistics.median(times["off"]), statistics.median(times["on"])],
                           dtype=torch.float64)
    comm.all_reduce(medians, op="max", algorithm="native")
    off, on = medians.tolist()
    check_s = min(timeit.repeat(lambda: world_mod.recorder() is None, number=100_000,
                                repeat=5)) / 100_000
    recorder = Recorder("unused.json", world.rank)  # never closed: writes nothing
    span_s = min(timeit.repeat(lambda: recorder.begin_comm("all_reduce", 4096, "native", 2,
                                                           False).end(),
                               number=100_000, repeat=5)) / 100_000
    if world.is_main:
        print(f"{world.world_size} ranks ({world.backend}), {args.kib} KiB all_reduce, "
              f"{args.calls} calls x {args.rounds} rounds, median per call:")
        print(f"  timeline off {off * 1e6:8.2f} us")
        print(f"  timeline on  {on * 1e6:8.2f} us   ({(on / off - 1) * 100:+.1f}%)")
        print(f"  the off check alone: {check_s * 1e9:.0f} ns per hook "
              f"({check_s / off * 100:.3f}% of a call)")
        print(f"  recording one span alone: {span_s * 1e6:.2f} us "
              f"({span_s / off * 100:.2f}% of a call)")


if __name__ == "__main__":
    main()
