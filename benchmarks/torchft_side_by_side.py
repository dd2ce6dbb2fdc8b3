"""dtrain's live replicas beside torchft's Manager: the same job, one live replica's rank
SIGKILLed at the same step, each side bringing the live replica back.

    python benchmarks/torchft_side_by_side.py [--steps 120 --kill-at 10] [--write]
    python benchmarks/torchft_side_by_side.py --only torchft --steps 30   # one side, quick

The job: dtrain's GPT at 2 layers, 128 wide, blocks of 128 tokens on the default corpus,
global batch 16, AdamW with dtrain's warm-up and cosine schedule, no gradient clipping,
seeded alike: 4 ranks on gloo as 2 live replicas of 2 ranks (torchft: replica groups).
Each side runs once undisturbed and once with live replica 1's second rank (global rank 3)
SIGKILLed once step `kill-at` - 1 is recorded (so within step `kill-at`), then started
again:

- torchft (0.2): a lighthouse on 127.0.0.1 (the server of `torchft_lighthouse
  --min_replicas 1`, started in this process), two
  replica groups of two processes started by this script, each group with a store and a
  gloo group of its own. Each rank averages its gradients (one flat buffer) inside its
  group, then across the groups with `Manager.allreduce`, and steps only if
  `Manager.should_commit()`: HSDP-style, with plain data parallelism inside a group. When
  a rank dies, this script stops the rest of its group and starts the group again, as
  torchrun's agent would (`--max-restarts 1`); the new group heals from the live one.
- dtrain: `dtrain train -n 4 --max-restarts 1` with `[fault_tolerance] mode = "live"`,
  `parallel.dp = 2`, `parallel.zero = 2`: live replicas refuse plain data parallelism
  inside a replica (the replicas are the data parallelism), so each replica is ZeRO-2 over
  its 2 ranks, the nearest to torchft's groups (the same averages, gradients
  reduce-scattered instead of all-reduced inside the replica).

Reported per run: steps lost (steps the survivors computed and then threw away: torchft
does not commit the step the replica died in and computes it again; dtrain's survivors
reduce that step again without the dead replica), steps averaged over one replica only,
seconds from the kill to the survivors' first completed step without the dead replica,
seconds from the kill to the first step the replacement took part in again, whether the
losses before the kill equal the undisturbed run's (they should: nothing differs yet), and
whether the final weights do (they should not where a step was averaged over one replica:
its data is missing from that step), and, for torchft, whether the restarted group ends
with the surviving group's weights. The undisturbed runs of the two sides are compared
with each other too: they are not the same numbers (step 1's loss already differs).

It prints one JSON object; `--json PATH` writes it there, `--write` puts the table in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG = """
[model]
n_layer = 2
n_head = 4
n_embd = 128
block_size = 128

[data]
max_bytes = 400000

[train]
batch_size = 16
eval_every = 0
eval_batches = 1

[optimizer]
grad_clip = 0.0

[comm]
backend = "gloo"

[checkpoint]
every = 0

[logging]
log_every = 1000
sample_tokens = 0
"""

GROUPS, GROUP_RANKS = 2, 2  # replicas (torchft: replica groups) and ranks in each
VICTIM = (1, 1)  # (replica, its rank): global rank 3
TIMEOUT_S = 5.0  # torchft's collectives and dtrain's step_timeout alike
HEARTBEAT_S = 2.0  # the lighthouse's heartbeat timeout and dtrain's


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(folder: Path, steps: int) -> Path:
    path = folder / "job.toml"
    path.write_text(CONFIG.replace("[train]\n", f"[train]\nsteps = {steps}\n"))
    return path


# --- torchft: one rank of a replica group ---------------------------------------------

def torchft_rank(config_path: str, out: str, control_port: int) -> None:
    """One rank of a torchft replica group (env: MASTER_ADDR/PORT, the group's store;
    RANK, WORLD_SIZE in the group; REPLICA_GROUP_ID; TORCHFT_LIGHTHOUSE; GENERATION)."""
    from torchft import Manager, ProcessGroupGloo

    from dtrain import models
    from dtrain.config import load_config
    from dtrain.data import batches, open_data
    from dtrain.layouts.holding import model_loss
    from dtrain.optim import build_optimizer, lr_factor

    torch.set_num_threads(1)
    group, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    generation = int(os.environ["GENERATION"])
    config = load_config(config_path, [])
    tc, mc, dc = config.train, config.model, config.data
    data = open_data(dc.path, dc.format, dc.tokenizer, dc.max_bytes, dc.val_fraction,
                     mc.block_size)
    torch.manual_seed(tc.seed)
    model = models.build(models.resolve(mc, data.vocab_size))
    optimizer = build_optimizer(model.parameters(), config.optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, tc.steps, config.optimizer))

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("inside", store), rank=rank,
                            world_size=GROUP_RANKS, timeout=timedelta(seconds=30))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S)), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       optimizer.load_state_dict(state["optim"]),
                                       schedule.load_state_dict(state["schedule"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict(),
                            "schedule": schedule.state_dict()},
        replica_id=f"group{group}", rank=rank, world_size=GROUP_RANKS,
        hostname="127.0.0.1", timeout=timedelta(seconds=TIMEOUT_S),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    control = dist.TCPStore("127.0.0.1", control_port, is_master=False,
                            timeout=timedelta(seconds=60))
    if generation == 0:  # both groups in the first quorum, as dtrain's replicas are
        control.add("ready", 1)
        while int(control.get("ready")) < GROUPS * GROUP_RANKS:
            time.sleep(0.01)
    params = [p for p in model.parameters() if p.requires_grad]
    records = open(Path(out) / f"g{group}r{rank}.gen{generation}.jsonl", "a")
    while manager.current_step() < tc.steps:
        began = time.time()
        manager.start_quorum()
        optimizer.zero_grad()
        step = manager.current_step()  # 0-based: the batch of dtrain's step + 1
        x, y = next(batches(data.train, tc.batch_size, GROUPS * GROUP_RANKS,
                            group * GROUP_RANKS + rank, tc.seed, shuffle=True, start=step))
        loss = model_loss(model, (x, y)).float()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)  # inside the group: its mean
        flat /= GROUP_RANKS
        manager.allreduce(flat).wait()  # across the groups taking part: their mean
        dist.all_reduce(loss.detach())
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        participants = manager.num_participants()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
            schedule.step()
        records.write(json.dumps({"step": step + 1, "began": began, "time": time.time(),
                                  "committed": committed, "live_replicas": participants,
                                  "loss": loss.item() / GROUP_RANKS}) + "\n")
        records.flush()
    if rank == 0:
        torch.save(model.state_dict(), Path(out) / f"g{group}.final.pt")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def records_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Lighthouse:
    """torchft's lighthouse (the Rust server `torchft_lighthouse` runs), served from this
    process on 127.0.0.1: `--min_replicas 1`, a join timeout of 5 s and HEARTBEAT_S."""

    def __init__(self) -> None:
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                       join_timeout_ms=5000,
                                       heartbeat_timeout_ms=int(HEARTBEAT_S * 1000))

    def address(self) -> str:
        """Its address, by IP (the server names this machine's host name)."""
        return "http://127.0.0.1:" + self.server.address().rsplit(":", 1)[1]

    def shutdown(self) -> None:
        self.server.shutdown()


def run_torchft(folder: Path, config: Path, kill_at: int | None, restarts: int = 1) -> dict:
    """The torchft job once (the victim SIGKILLed within step `kill_at`, unless None; a
    failed group started again up to `restarts` times)."""
    lighthouse = Lighthouse()
    control_port = free_port()
    control = dist.TCPStore("127.0.0.1", control_port, is_master=True,
                            wait_for_workers=False, timeout=timedelta(seconds=60))
    control.set("ready", "0")
    stores: dict[int, dist.TCPStore] = {}
    generation = dict.fromkeys(range(GROUPS), 0)
    procs: dict[int, list[subprocess.Popen]] = {}

    def start(group: int) -> None:
        stores[group] = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=60))
        procs[group] = [subprocess.Popen(
            [sys.executable, __file__, "--torchft-rank", str(config), str(folder),
             str(control_port)],
            env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(stores[group].port), "RANK": str(rank),
                 "WORLD_SIZE": str(GROUP_RANKS), "REPLICA_GROUP_ID": str(group),
                 "GENERATION": str(generation[group]), "OMP_NUM_THREADS": "1",
                 "TORCHFT_LIGHTHOUSE": lighthouse.address()},
            stdout=subprocess.DEVNULL,
            stderr=open(folder / f"g{group}r{rank}.gen{generation[group]}.log", "w"))
            for rank in range(GROUP_RANKS)]

    survivor = folder / "g0r0.gen0.jsonl"
    killed = restarted = None
    try:
        for group in range(GROUPS):
            start(group)
        deadline = time.monotonic() + 600
        while any(p.poll() is None for ps in procs.values() for p in ps):
            assert time.monotonic() < deadline, "the torchft job did not finish"
            if kill_at is not None and killed is None and any(
                    r["committed"] and r["step"] >= kill_at - 1 for r in records_of(survivor)):
                procs[VICTIM[0]][VICTIM[1]].send_signal(signal.SIGKILL)
                killed = time.time()
            for group, ps in list(procs.items()):
                if any(p.poll() not in (None, 0) for p in ps):  # torchrun's agent: the
                    for p in ps:  # group's other ranks stopped, the group started again
                        p.kill()
                        p.wait()
                    del procs[group]
                    if generation[group] < restarts:
                        generation[group] += 1
                        start(group)
                        restarted = time.time()
            time.sleep(0.05)
        assert kill_at is None or killed is not None, "the job ended before the kill"
    finally:
        for p in (p for ps in procs.values() for p in ps):  # (an assertion failed)
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    weights = [torch.load(path) for path in sorted(folder.glob("g*.final.pt"))]
    return {"records": records_of(survivor), "killed": killed, "restarted": restarted,
            "weights": weights[0], "groups_equal": all(
                torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])}


# --- dtrain: dtrain train with live replicas --------------------------------------------

def run_dtrain(folder: Path, config: Path, kill_at: int | None, standby: bool = True) -> dict:
    """`dtrain train` with live replicas once (the victim SIGKILLed within step
    `kill_at`, unless None), each rank's replacement started from a warm standby process
    or, `standby=False`, from a fresh one."""
    from dtrain.checkpoint.universal import Checkpoint
    from dtrain.launch.waker import children

    metrics = folder / "metrics.jsonl"
    command = [sys.executable, "-m", "dtrain.cli", "train", str(config), "-n", "4",
               "--max-restarts", "1", "--metrics", str(metrics),
               "--set", "fault_tolerance.mode='live'", "--set", f"fault_tolerance.step_timeout="
               f"{TIMEOUT_S}", "--set", "parallel.dp=2", "--set", "parallel.zero=2",
               "--set", f"fault_tolerance.standby={str(standby).lower()}",
               "--set", f"train.out_dir='{folder / 'run'}'"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                            stderr=open(folder / "dtrain.log", "w"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    killed = restarted = supervisor = None
    victim = VICTIM[0] * GROUP_RANKS + VICTIM[1]
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the dtrain job did not finish"
            if kill_at is not None and killed is None and any(
                    r["step"] >= kill_at - 1 for r in records_of(metrics)):
                supervisor = next(pid for pid in children(proc.pid)
                                  if f"RANK={victim}\0".encode() in
                                  Path(f"/proc/{pid}/environ").read_bytes())
                rank = next(iter(children(supervisor)))
                os.kill(rank, signal.SIGKILL)
                killed = time.time()
            if killed and restarted is None and set(children(supervisor)) - {rank}:
                restarted = time.time()  # the supervisor's new rank
            time.sleep(0.05)
        assert proc.returncode == 0, (folder / "dtrain.log").read_text()[-3000:]
        assert kill_at is None or killed is not None, "the job ended before the kill"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    records = [{**r, "committed": True} for r in records_of(metrics) if "loss" in r]
    return {"records": records, "killed": killed, "restarted": restarted,
            "weights": Checkpoint(folder / "run" / "checkpoints").model_state()}


# --- the measures -----------------------------------------------------------------------

def measures(run: dict, calm: dict, kill_at: int) -> dict:
    """What one disturbed run lost and took, against its side's undisturbed run. A moment
    the run ended before (no step without the dead live replica, or none with its
    replacement back: a short `--steps`) is None, reported as not reached."""
    records, killed = run["records"], run["killed"]
    done = [r for r in records if r["committed"]]
    steps = [r["step"] for r in done]
    alone = next((r for r in done if r["time"] > killed and r["live_replicas"] == 1), None)
    back = None if alone is None else next(
        (r for r in done if r["time"] > alone["time"] and r["live_replicas"] == GROUPS), None)
    before = {r["step"]: r["loss"] for r in done if r["step"] < kill_at}
    calm_loss = {r["step"]: r["loss"] for r in calm["records"] if r["committed"]}
    diff = max((run["weights"][k] - calm["weights"][k]).abs().max().item()
               for k in calm["weights"])
    return {
        "steps_lost": sum(1 for r in records if not r["committed"] and r["time"] > killed),
        "steps_missing_or_repeated": len(set(range(1, max(steps) + 1)) ^ set(steps))
        + len(steps) - len(set(steps)),
        "one_replica_steps": sum(1 for r in done if r["live_replicas"] < GROUPS),
        "kill_to_survivors_step_s": None if alone is None else round(alone["time"] - killed, 2),
        "kill_to_replacement_started_s": None if run["restarted"] is None
        else round(run["restarted"] - killed, 2),
        "kill_to_rejoined_step_s": None if back is None else round(back["time"] - killed, 2),
        "losses_before_kill_equal": all(before[s] == calm_loss[s] for s in before),
        "final_weights_equal": diff == 0.0,
        "final_weights_max_diff": diff,
    }


def step_time(run: dict) -> float:
    done = sorted(r["time"] for r in run["records"] if r["committed"])
    gaps = sorted(b - a for a, b in zip(done[5:], done[6:], strict=False))
    return gaps[len(gaps) // 2]


SIDES = {"torchft": run_torchft, "dtrain": run_dtrain,
         "dtrain, no standby": lambda folder, config, kill_at:
             run_dtrain(folder, config, kill_at, standby=False)}
"""Each side and how it runs: dtrain as it is (a replacement started from a warm standby
process, `fault_tolerance.standby = true`, the default) and with fresh processes only."""
TIMES = ("kill_to_survivors_step_s", "kill_to_replacement_started_s", "kill_to_rejoined_step_s")


def summary(runs: list[dict]) -> dict:
    """Several killed runs of one side at one kill point as one: the median of each time
    (None if any run did not reach that moment), the worst of the counts, all of the
    equalities."""
    def median(values: list) -> float | None:
        if any(v is None for v in values):
            return None
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    out = {key: median([r[key] for r in runs]) for key in TIMES}
    out.update({f"{key}_each": [r[key] for r in runs] for key in TIMES})
    for key in ("steps_lost", "steps_missing_or_repeated", "final_weights_max_diff"):
        out[key] = max(r[key] for r in runs)
    out["one_replica_steps"] = median([r["one_replica_steps"] for r in runs])
    for key in ("losses_before_kill_equal", "replacement_equals_survivor"):
        if key in runs[0]:
            out[key] = all(r[key] for r in runs)
    out["final_weights_equal"] = any(r["final_weights_equal"] for r in runs)
    return out


def table(report: dict, args: argparse.Namespace) -> list[str]:
    sides = [s for s in SIDES if s in report]
    each = [("seconds per step, undisturbed (median)", "step_s", None)]
    for kill_at in args.kill_at:
        at = f" (kill in step {kill_at})"
        each += [
            ("steps lost (computed by the survivors, then thrown away)" + at, "steps_lost",
             kill_at),
            ("steps missing or repeated in the record" + at, "steps_missing_or_repeated",
             kill_at),
            ("steps averaged over one live replica (torchft: replica group) only" + at,
             "one_replica_steps", kill_at),
            ("SIGKILL -> the survivors' first completed step without the dead live replica"
             + at, "kill_to_survivors_step_s", kill_at),
            ("SIGKILL -> the replacement's processes started" + at,
             "kill_to_replacement_started_s", kill_at),
            ("**SIGKILL -> the first step the replacement took part in**" + at,
             "kill_to_rejoined_step_s", kill_at),
            ("losses before the kill equal the undisturbed run's" + at,
             "losses_before_kill_equal", kill_at),
            ("final weights: largest difference from the undisturbed run" + at,
             "final_weights_max_diff", kill_at),
        ]

    def cell(side: str, key: str, kill_at: int | None) -> str:
        found = report[side] if kill_at is None else report[side][str(kill_at)]
        value = found[key]
        if value is None:  # the run ended first
            return f"not within the {args.steps} steps"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if key.endswith("_s"):
            runs = found.get(f"{key}_each", [])
            spread = "" if len(runs) < 2 else \
                " (" + ", ".join("-" if v is None else f"{v:.2f}" for v in runs) + ")"
            return f"{value:.2f} s{spread}"
        if isinstance(value, float):
            return f"{value:.2g}"
        return str(value)

    kills = " ".join(map(str, args.kill_at))
    lines = [
        "## Live replicas beside torchft: one live replica's SIGKILL, 2 live replicas of 2 ranks",
        "",
        f"Command: `python benchmarks/torchft_side_by_side.py --steps {args.steps} "
        f"--kill-at {kills} --repeat {args.repeat} --write` (torchft "
        f"{report['torchft_version']}, torch {torch.__version__}, gloo on CPU, "
        f"{os.cpu_count()} cores; load average {report['load_before']:.1f} before, "
        f"{report['load_after']:.1f} after). Each side runs once undisturbed and "
        f"{args.repeat} times per kill point, the sides taking turns; times are medians, "
        "each run's in brackets. dtrain's GPT (2 layers, 128 wide, blocks of 128 tokens), "
        "global batch 16, AdamW, the same seed and data on both sides; rank 3 (replica 1's "
        "second rank) is SIGKILLed once the step before the kill point is recorded, and "
        "started again (torchft: its group restarted by the driver, as torchrun's agent "
        "would; dtrain: `--max-restarts 1`, the replica's other rank restarted too by its "
        "supervisor). torchft: the lighthouse's "
        f"`--min_replicas 1 --heartbeat_timeout_ms {int(HEARTBEAT_S * 1000)} "
        f"--join_timeout_ms 5000`, Manager timeout {TIMEOUT_S:g} s, gradients averaged "
        "inside each group then across groups; dtrain: `fault_tolerance.step_timeout = "
        f"{TIMEOUT_S:g}`, heartbeat timeout {HEARTBEAT_S:g} s, ZeRO-2 over each replica's 2 "
        "ranks (live replicas refuse plain data parallelism inside a replica), its "
        "replacement started from each rank's warm standby (`fault_tolerance.standby`, the "
        "default) and, in the last column, from fresh processes.",
        "",
        "| measure | " + " | ".join(sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for what, key, kill_at in each:
        lines.append(f"| {what} | " + " | ".join(cell(s, key, kill_at) for s in sides) + " |")
    if "torchft" in report:
        same = all(report["torchft"][str(k)]["replacement_equals_survivor"]
                   for k in args.kill_at)
        lines += ["", f"torchft's restarted group ends with weights that "
                  f"{'equal' if same else 'differ from'} the surviving group's (it healed "
                  "from it)."]
    if "cross_side_max_diff" in report:
        lines += ["", "The two undisturbed runs' final weights differ by up to "
                  f"{report['cross_side_max_diff']:.2g}: the sides run the same shapes, "
                  "batches and optimizer, but not the same numbers (step 1's loss "
                  f"already differs: {report['first_losses']}), so only each side's "
                  "runs are compared with each other."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, nargs="+", default=[10, 60],
                        help="the steps a kill falls in, each a run of its own")
    parser.add_argument("--repeat", type=int, default=3,
                        help="killed runs per side and kill point")
    parser.add_argument("--only", choices=tuple(SIDES), default=None)
    parser.add_argument("--keep", default=None, help="keep the runs' files in this folder")
    parser.add_argument("--json", default=None)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    from importlib.metadata import version

    report: dict = {"torchft_version": version("torchft"), "load_before": os.getloadavg()[0]}
    folder = Path(args.keep or tempfile.mkdtemp(prefix="torchft-side-"))
    sides = [side for side in SIDES if args.only in (None, side)]
    calm: dict[str, dict] = {}
    killed: dict[tuple[str, int], list[dict]] = {}

    def once(side: str, name: str, kill_at: int | None) -> dict:
        where = folder / side.replace(", ", "-").replace(" ", "-") / name
        where.mkdir(parents=True, exist_ok=True)
        run = SIDES[side](where, write_config(where, args.steps), kill_at)
        print(f"{side} {name}: done", file=sys.stderr, flush=True)
        return run

    try:
        for side in sides:
            calm[side] = once(side, "calm", None)
        for kill_at in args.kill_at:
            for turn in range(args.repeat):  # the sides take turns: alike conditions
                for side in sides:
                    run = once(side, f"killed-{kill_at}-{turn}", kill_at)
                    found = measures(run, calm[side], kill_at)
                    if side == "torchft":
                        found["replacement_equals_survivor"] = run["groups_equal"]
                    killed.setdefault((side, kill_at), []).append(found)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    for side in sides:
        if side == "torchft":
            assert calm[side]["groups_equal"], "the undisturbed groups differ"
        report[side] = {"step_s": step_time(calm[side]),
                        **{str(k): summary(killed[side, k]) for k in args.kill_at}}
    if "torchft" in calm and "dtrain" in calm:
        report["first_losses"] = " vs ".join(f"{side} {calm[side]['records'][0]['loss']:.4f}"
                                             for side in ("torchft", "dtrain"))
        report["cross_side_max_diff"] = max(
            (calm["torchft"]["weights"][k] - calm["dtrain"]["weights"][k]).abs().max().item()
            for k in calm["dtrain"]["weights"])
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    lines = table(report, args)
    print("\n".join(lines))
    if args.write:
        from results_md import replace_section

        replace_section("torchft", lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchft-rank"]:
        torchft_rank(*sys.argv[2:4], int(sys.argv[4]))
    else:
        main()
