"""Context parallelism's proof figures: the longest sequence a small Llama trains under a
per-rank cap of live tensor bytes (one process, cp=4, tp=4 with sequence parallelism,
cp=2 x tp=2 with it); cp=4's step time at one long sequence by ring, allgather and
alltoall, and the share of the ring's messages hidden behind its compute; torch's own
`context_parallel` on the same model and sequence.

    python benchmarks/long_context.py [--cap-mib 64 --seq 4096 --write]

Memory. A probe is one spawned world (memory_cap's `under_cap`: src/dtrain/testing/processes.py's
`run_ranks`, gloo, 1 thread per rank) that builds the Llama and trains it STEPS steps with
AdamW on one sequence of `seq` tokens, construction included, under
`dtrain.planner.LiveBytes(limit=cap)` on every rank. The model is built in split form
(init.skeleton -> layouts.build: each rank allocates only what it holds) for the dtrain
layouts, whole for one process; no recomputation anywhere, so the activations are what
the layouts split. `seq` is searched in units of UNIT tokens, a multiple of 2 x cp x tp
for every setup (memory_cap's `search`: one process doubling from 1024 tokens, the others
from 4x one process's answer, perfect sharding, in steps of 25%; then bisection).
dtrain's collectives with algorithm "auto" time their candidates on first use: every
dtrain probe first trains a step at UNIT tokens on the same mesh, outside the cap.

Time. One world of 4 ranks builds cp=4 three times (one per `cp_method`, the same initial
weights) and trains them in turns, one step each per round: the figure is the median over
rounds of each step's slowest rank, after warm-up rounds. Then the ring trains more steps
with a timeline recorder installed (dtrain.timeline.Recorder): its "cp ring step" spans are
the compute of each ring step, its "send"/"recv" spans each message from its issue to the
end of its wait. The hidden share is, over every send and recv of every rank, the time
during which the same rank was inside a "cp ring step" span, over their whole time.

Against torch: the same Llama, weights and sequence on 4 ranks, plain SDPA attention (the
kernel torch picks, then its math formulas), under
`torch.distributed.tensor.experimental.context_parallel` (its ring on SDPA, the
inputs sharded by its head-tail balancer, the zigzag dtrain's chunks also use, whose
global positions the rotary angles are given), gradients averaged by dtrain's
DataParallel. Its first loss is checked against one process's on the whole sequence.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from memory_cap import found_table, probe_list, under_cap
from memory_cap import search as search_largest
from results_md import replace_section

import dtrain
from dtrain import comm, layouts, models, timeline
from dtrain.config import config_from_dict, dims_of
from dtrain.context_parallel import METHODS, ContextParallel, chunks
from dtrain.mesh import Mesh
from dtrain.models import init
from dtrain.optim import build_optimizer
from dtrain.planner import LiveBytes
from dtrain.train.trainer import chunks_of

MiB = 2**20
VOCAB = 256
SHAPE = {"arch": "llama", "n_layer": 2, "n_embd": 128, "n_head": 8, "n_kv_head": 4,
         "ffn_hidden": 384, "tie_embeddings": False}
STEPS = 2  # the second step's forward and backward hold AdamW's state too
UNIT = 64  # tokens: the search's step; 2 x cp x tp divides it in every setup
SETUPS = {"one_process": {}, "cp4": {"cp": 4},
          "tp4_sp": {"tp": 4, "sequence_parallel": True},
          "cp2_tp2_sp": {"cp": 2, "tp": 2, "sequence_parallel": True}}
NAMES = {"one_process": "(a) one process",
         "cp4": "(b) cp=4, ring (4 ranks)",
         "tp4_sp": "(c) tp=4, sequence parallel (4 ranks)",
         "cp2_tp2_sp": "(d) cp=2 x tp=2, sequence parallel, ring (4 ranks)"}


def config_of(setup: str, seq: int, method: str = "ring", world_size: int = 4):
    parallel = SETUPS[setup]
    return config_from_dict({
        "model": {**SHAPE, "block_size": seq},
        "optimizer": {"name": "adamw"},
        "train": {"batch_size": 1, "seed": 0},
        "parallel": {"nproc": 1 if setup == "one_process" else world_size, **parallel,
                     **({"cp_method": method} if "cp" in parallel else {})},
    })


def tokens(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of `seq` tokens and its targets, alike on every rank."""
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    return ids[:, :-1], ids[:, 1:]


def build(config, mesh: Mesh):  # noqa: ANN201
    """The Llama in split form, held in the config's layout on `mesh`."""
    model = init.skeleton(lambda: models.build(models.resolve(config.model, VOCAB)))
    return layouts.build(model, mesh, config)


def step(held, x: torch.Tensor, y: torch.Tensor) -> float:  # noqa: ANN001
    loss = held.forward_backward([(x, y)])
    held.step()
    held.zero_grad()
    return float(loss)


def mesh_of(setup: str) -> Mesh:
    return Mesh(dims_of(config_of(setup, UNIT), dtrain.world.current().world_size))


# ------------------------------------------------------------------ memory: one rank's probe
def probe(setup: str, seq: int, cap: int | None) -> tuple[int, float]:
    """This rank's peak live bytes and last loss, training STEPS steps of `seq` tokens."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    tracker = LiveBytes(limit=cap)
    x, y = tokens(seq)
    if setup == "one_process":
        config = config_of(setup, seq)
        with tracker:
            torch.manual_seed(0)
            model = models.build(models.resolve(config.model, VOCAB))
            optimizer = build_optimizer(model.parameters(), config.optimizer)
            for _ in range(STEPS):
                loss = model(x, y)[1]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        return tracker.peak, loss.item()
    mesh = mesh_of(setup)
    with LiveBytes():  # collectives calibrated outside the cap
        step(build(config_of(setup, UNIT), mesh), *(chunks_of(t, mesh) for t in tokens(UNIT)))
    with tracker:
        held = build(config_of(setup, seq), mesh)
        x, y = chunks_of(x, mesh), chunks_of(y, mesh)
        for _ in range(STEPS):
            loss = step(held, x, y)
    return tracker.peak, loss


def trains(setup: str, seq: int, cap: int | None, log: list[dict]) -> bool:
    """Whether `seq` tokens train STEPS steps under the cap on every rank (one world)."""
    start = time.perf_counter()
    results = under_cap(probe, 1 if setup == "one_process" else 4, setup, seq, cap)
    peak = None if results is None else max(p for p, _ in results)
    seconds = time.perf_counter() - start
    log.append({"setup": setup, "seq": seq, "trains": results is not None, "peak": peak,
                "seconds": round(seconds, 1)})
    print(f"{setup:>12} seq={seq:6d}: "
          f"{'over the cap' if peak is None else 'trains, peak %.1f MiB' % (peak / MiB)} "
          f"({seconds:.0f} s)", flush=True)
    return results is not None


def longest(setup: str, start: int, growth: float, cap: int, log: list[dict]) -> int:
    """The longest sequence, in tokens, that trains under the cap."""
    return UNIT * search_largest(lambda n: trains(setup, n * UNIT, cap, log), start // UNIT,
                                 growth, setup)


# ------------------------------------------------------------------ time: cp=4's methods
def hidden_share(events: list[dict]) -> tuple[float, float]:
    """(seconds of send/recv in flight, of which inside a "cp ring step" span), one rank's
    trace events."""
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e["name"] == "cp ring step")
    total = hidden = 0.0
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "comm" and e["name"] in ("send", "recv"):
            start, end = e["ts"], e["ts"] + e["dur"]
            total += end - start
            hidden += sum(max(0.0, min(end, b) - max(start, a)) for a, b in compute)
    return total / 1e6, hidden / 1e6


def time_methods(seq: int, rounds: int, warmup: int, traced: int) -> dict:
    """One rank: each method's step seconds per round, the ring's traced steps' seconds
    and its (send/recv seconds, hidden seconds), and each method's first loss."""
    mesh = mesh_of("cp4")
    x, y = (chunks_of(t, mesh) for t in tokens(seq))
    held = {m: build(config_of("cp4", seq, m), mesh) for m in METHODS}
    seconds: dict[str, list[float]] = {m: [] for m in METHODS}
    first = {}
    for r in range(warmup + rounds):
        for m in METHODS:
            comm.barrier()
            start = time.perf_counter()
            loss = step(held[m], x, y)
            if r >= warmup:
                seconds[m].append(time.perf_counter() - start)
            first.setdefault(m, loss)
    traced_seconds, shares = [], []
    for _ in range(traced):  # a recorder per step, never closed: nothing is written
        recorder = timeline.Recorder("unused.json", dtrain.world.current().rank)
        comm.barrier()
        timeline.install(recorder)
        try:
            start = time.perf_counter()
            step(held["ring"], x, y)
            traced_seconds.append(time.perf_counter() - start)
        finally:
            timeline.install(None)
        shares.append(hidden_share(recorder.events()))
    return {"seconds": seconds, "traced": traced_seconds, "comm": shares, "first": first}


# ------------------------------------------------------------------ torch's context_parallel
def torch_cp(seq: int, steps: int, warmup: int, backend: str) -> dict:
    """One rank: torch's context_parallel on the cp=4 Llama, SDPA's kernel chosen by torch
    (`backend` "default") or its "math" formulas; its step seconds and first loss, one
    process's loss on the whole sequence (rank 0), or the error's first line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    world = dtrain.world.current()
    config = config_of("one_process", seq)
    model = init.skeleton(lambda: models.build(models.resolve(config.model, VOCAB)))
    initial = init.Initial(model, config.train.seed)  # the weights layouts.build gives
    init.allocate(model, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial.tensor(name))
    x, y = tokens(seq)
    whole = None
    if world.rank == 0:
        with torch.no_grad():
            whole = model(x, y)[1].item()
    # positions only: the rotary angles of this rank's chunks in the whole sequence (torch's
    # head-tail balancer cuts the zigzag chunks.shard does); attention stays plain SDPA
    model.context = ContextParallel(comm.resolve(None), "ring")
    wrapped = dtrain.DataParallel(model)
    optimizer = build_optimizer(model.parameters(), config.optimizer)
    mesh = init_device_mesh("cpu", (world.world_size,))
    seconds, first = [], None
    try:
        for i in range(warmup + steps):
            xs, ys = x.clone(), y.clone()  # sharded in place by context_parallel
            comm.barrier()
            start = time.perf_counter()
            kernel = sdpa_kernel(SDPBackend.MATH) if backend == "math" else nullcontext()
            with kernel, context_parallel(mesh, buffers=[xs, ys], buffer_seq_dims=[1, 1],
                                          no_restore_buffers={xs, ys}):
                loss = wrapped(xs, ys)[1]
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
            if first is None:
                first = comm.all_reduce(loss.detach(), op="avg").item()
                mine = chunks.shard(x, world.rank, world.world_size)
                assert torch.equal(xs, mine), "torch's shard is not dtrain's zigzag"
    except Exception as exc:  # noqa: BLE001 - the figure is the error itself
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}",
                "whole": whole}
    return {"seconds": seconds, "first": first, "whole": whole}


# ------------------------------------------------------------------ the run
def slowest_median(per_rank: list[list[float]]) -> float:
    """The median over steps of each step's slowest rank."""
    return statistics.median(max(ts) for ts in zip(*per_rank, strict=True))


def timing(seq: int, rounds: int, warmup: int, traced: int) -> dict:
    results = run_world(time_methods, seq, rounds, warmup, traced)
    out = {m: {"median": slowest_median([r["seconds"][m] for r in results]),
               "all": [round(max(ts), 3) for ts in
                       zip(*(r["seconds"][m] for r in results), strict=True)],
               "first": statistics.mean(r["first"][m] for r in results)} for m in METHODS}
    # per traced step, over all ranks: (send/recv seconds, hidden seconds)
    steps = [tuple(map(sum, zip(*(r["comm"][i] for r in results), strict=True)))
             for i in range(traced)]
    in_flight, hidden = (sum(col) for col in zip(*steps, strict=True))
    out["ring_traced"] = {"median": slowest_median([r["traced"] for r in results]),
                          "comm_s": in_flight, "hidden_s": hidden,
                          "hidden_share": hidden / in_flight,
                          "step_shares": [round(h / c, 3) for c, h in steps],
                          "per_rank": [round(sum(h for _, h in r["comm"])
                                             / sum(c for c, _ in r["comm"]), 3)
                                       for r in results]}
    return out


def run_world(fn, *args):  # noqa: ANN001, ANN201
    results = under_cap(fn, 4, *args)
    assert results is not None, "no cap is set here"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096, help="the timed sequence's tokens")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--traced", type=int, default=5)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--parts", default="memory,time,torch")
    parser.add_argument("--probe", metavar="SETUP:SEQ", help="run one probe only (no cap)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--from-json", metavar="PATH", help="write the section of a saved run")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.probe:
        setup, seq = args.probe.split(":")
        trains(setup, int(seq), None, [])
        return
    if args.from_json:
        replace_section("long_context", section(json.loads(Path(args.from_json).read_text())))
        return
    cap, parts = args.cap_mib * MiB, args.parts.split(",")
    summary: dict = {"cap_mib": args.cap_mib, "seq": args.seq, "rounds": args.rounds,
                     "warmup": args.warmup, "traced": args.traced, "load_before": os.getloadavg(),
                     "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    started = time.time()
    if "memory" in parts:
        log: list[dict] = []
        found: dict[str, int] = {}
        for setup in args.setups.split(","):
            start = 4 * found["one_process"] if "one_process" in found else 1024
            found[setup] = longest(setup, start, 2.0 if setup == "one_process" else 1.25,
                                   cap, log)
        summary["longest"] = {s: {"seq": n, "peak": next(
            p["peak"] for p in log if p["setup"] == s and p["seq"] == n and p["trains"])}
            for s, n in found.items()}
        summary["probes"] = log
        print(json.dumps(summary["longest"], indent=2), flush=True)
    if "time" in parts:
        summary["time"] = timing(args.seq, args.rounds, args.warmup, args.traced)
        print(json.dumps(summary["time"], indent=2), flush=True)
    if "torch" in parts:
        summary["torch"] = {}
        for backend in ("default", "math"):
            results = run_world(torch_cp, args.seq, args.rounds, args.warmup, backend)
            got = {"whole": results[0]["whole"]}
            if "error" in results[0]:
                got["error"] = results[0]["error"]
            else:
                got |= {"median": slowest_median([r["seconds"] for r in results]),
                        "first": results[0]["first"]}
            summary["torch"][backend] = got
            print(backend, json.dumps(got, indent=2), flush=True)
    summary["minutes"] = (time.time() - started) / 60
    summary["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.write:
        replace_section("long_context", section(summary))


def section(summary: dict) -> list[str]:
    cap, seq = summary["cap_mib"], summary["seq"]
    before, after = summary["load_before"], summary["load_after"]
    lines = [
        "## Long context: context parallelism",
        "",
        f"Command: `python benchmarks/long_context.py --cap-mib {cap} --seq {seq} --rounds "
        f"{summary['rounds']} --warmup {summary['warmup']} --write`  ",
        f"Date: {summary['date']}. Machine: {os.cpu_count()} cores, {platform.machine()}, "
        f"torch {torch.__version__}, gloo, 1 thread per rank (4 ranks share the 2 cores); "
        f"load average (1, 5, 15 min) {', '.join(f'{v:.1f}' for v in before)} before, "
        f"{', '.join(f'{v:.1f}' for v in after)} after (shared with other work); "
        f"{summary['minutes']:.0f} min in all.  ",
        f"Model: dtrain's Llama, {SHAPE['n_layer']} layers, width {SHAPE['n_embd']}, "
        f"{SHAPE['n_head']} heads, {SHAPE['n_kv_head']} key/value heads (so that tp=4 and "
        f"cp=4's alltoall divide them), SwiGLU {SHAPE['ffn_hidden']}, vocabulary {VOCAB}, "
        "one sequence per step, AdamW (dtrain's `[optimizer]` defaults), no recomputation.",
    ]
    if "longest" in summary:
        rows = summary["longest"]
        base = rows.get("one_process", {}).get("seq")
        lines += [
            "",
            f"### The longest sequence under a per-rank cap of {cap} MiB of live tensors",
            "",
            f"{STEPS} steps, construction included, under `dtrain.planner.LiveBytes(limit="
            f"{cap} MiB)` on every rank; the length searched in steps of {UNIT} tokens "
            "(one process: doubling from 1024; the others: from 4x one process's answer, "
            "in steps of 25%; then bisection), each probe one spawned world. Every rank's "
            "attention is flash-style on the CPU (one process and tp: SDPA's fused CPU "
            "kernel; the ring: the same kernel per block), so no probe holds T^2 scores.",
            "",
            *found_table(rows, NAMES, ["longest sequence (tokens)"], "seq",
                         lambda row: [str(row["seq"])]),
            "",
            "Every probe (tokens: peak MiB of the busiest rank, or over the cap):",
            "",
            *probe_list(rows, summary["probes"], "seq"),
        ]
        if base and "cp4" in rows:
            times = rows["cp4"]["seq"] / base
            lines += ["", "| target | value | met? |", "|---|---|---|",
                      f"| (b) at least 3.5x (a) | {times:.2f}x | "
                      f"{'yes' if times >= 3.5 else 'no'} |"]
            if "tp4_sp" in rows:
                lines += [f"| (b) against (c), reported | {rows['cp4']['seq']} vs "
                          f"{rows['tp4_sp']['seq']} tokens "
                          f"({rows['cp4']['seq'] / rows['tp4_sp']['seq']:.2f}x) | - |", "",
                          "(c) holds more per token than (b) because sequence parallelism "
                          "splits the sequence only between the split layers: each "
                          "column-parallel layer (q/k/v, gate/up, the head) all-gathers "
                          "its whole-sequence input, which autograd keeps for its "
                          "backward, on every rank."]
    whole = next((got["whole"] for got in summary.get("torch", {}).values()), None)
    if "time" in summary:
        t = summary["time"]
        ring = t["ring_traced"]
        share = ring["hidden_share"]
        lines += [
            "",
            f"### cp=4 at {seq} tokens: step time by method, and the ring's hidden "
            "communication",
            "",
            f"One world of 4 ranks, the three methods built from the same initial weights "
            f"and stepped in turns (a barrier before each step), {summary['warmup']} rounds "
            f"of warm-up, then {summary['rounds']} rounds: the median over rounds of each "
            "step's slowest rank (forward, backward, gradient all-reduce, AdamW).",
            "",
            "| cp_method | step (s), median | every round's step (s) | first loss, mean over "
            "ranks |",
            "|---|---|---|---|",
        ]
        for m in METHODS:
            lines.append(f"| {m} | {t[m]['median']:.3f} | "
                         f"{', '.join(f'{s:.2f}' for s in t[m]['all'])} | "
                         f"{t[m]['first']:.4f} |")
        lines += [
            "",
            (f"One process's loss on the whole sequence with the same weights: {whole:.4f}. "
             if whole is not None else "")
            + "`allgather` computes twice the attention of the others here: its SDPA call "
            "takes an explicit mask (the zigzag chunks' global positions), and torch's CPU "
            "kernel computes every block of a masked call, where the ring's blocks and "
            "alltoall's causal SDPA skip the masked half.",
            "",
            f"The ring's messages, from {summary['traced']} more ring steps with a timeline "
            f"recorder installed (dtrain.timeline.Recorder; median step {ring['median']:.3f} "
            "s): every \"send\" and \"recv\" span (cat \"comm\": from the message's issue "
            "to the end of its `wait()`) against the same rank's \"cp ring step\" spans (cat "
            "\"cp\": each ring step's block computation, forward and backward). Hidden = the "
            "part of each send/recv interval that lies inside a cp ring step span, summed "
            "over all messages of all ranks, over their summed durations: "
            f"{ring['hidden_s']:.1f} s of {ring['comm_s']:.1f} s, **{share:.0%}** (per "
            f"step: {', '.join(f'{s:.0%}' for s in ring['step_shares'])}, median "
            f"{statistics.median(ring['step_shares']):.0%}; per rank: "
            f"{', '.join(f'{s:.0%}' for s in ring['per_rank'])}); target at least 50%: "
            f"{'met' if share >= 0.5 else 'missed'}. The rest is a rank waiting for a "
            "message after its block's compute has ended (4 ranks share 2 cores, so a "
            "neighbour is often behind), and the last gradient message of backward, which "
            "no compute follows.",
            "",
            "The share moves with the machine's other work more than any figure here: three "
            "earlier runs of this part on 2026-11-26 between 17:43 and 17:57, under load "
            "averages of 6 to 9 (2 cores), pooled over 2 or 3 traced steps, measured 74%, "
            "64% and 52% (one rank as low as 44%), with the ring's untraced step at "
            "1.30-1.47 s; a rank whose core is taken finishes its block late, and its "
            "neighbours' messages wait past their own blocks' end.",
        ]
    if "torch" in summary:
        lines += ["", f"### torch's `context_parallel` on the same model, {seq} tokens, 4 "
                  "ranks", "",
                  "`torch.distributed.tensor.experimental.context_parallel(mesh, buffers="
                  "[inputs, targets], buffer_seq_dims=[1, 1])` around forward and backward, "
                  "the Llama's attention plain SDPA, on 4 CPU gloo ranks:", ""]
        for backend, got in summary["torch"].items():
            what = ("SDPA as torch picks it" if backend == "default"
                    else "`sdpa_kernel(SDPBackend.MATH)`")
            if "error" in got:
                lines.append(f"- {what}: the first step raised `{got['error']}`")
            else:
                ring = summary.get("time", {}).get("ring", {}).get("median")
                lines.append(f"- {what}: runs, step {got['median']:.3f} s (median; dtrain's "
                             f"ring {ring:.3f} s), first loss {got['first']:.4f} against one "
                             f"process's {got['whole']:.4f}")
        if all("error" in got for got in summary["torch"].values()):
            lines += ["", "It does not run on CPU: its ring handles the CUDA SDPA kernels "
                      "(flash, efficient, cuDNN attention and their backwards), while SDPA on "
                      "the CPU runs `_scaled_dot_product_flash_attention_for_cpu`, which has "
                      "no sharding rule; its math formulas meet a plain tensor (the causal "
                      "mask) among the DTensors. So there is no step time to set beside "
                      "dtrain's ring on this machine."]
    return lines


if __name__ == "__main__":
    main()
