"""Run every fault test and drill and put what survived them in benchmarks/RESULTS.md.

    python benchmarks/fault_results.py --write

Runs each test of FAULTS (slow cases included) and the malformed-input suite with pytest,
the soak drills at the counts of `make soak` (DTRAIN_SOAK_ROUNDS=full: 20 crash-and-rejoins
of a host in a row, 20 hosts of a live job lost in turn, the etcd leader killed 10 times,
50 SIGKILLs of each save loop: blocking, background and replicated, 100 runs of the
pipeline example), reads the JUnit report (the tests' own output with it), and writes one
row per kind of fault: how many were injected, how many recovered as the test promises,
the steps lost, the updates lost or applied twice, and the time to recover (the bound the
test asserts, and the figure it measured where it prints one). The section says the date
and the commit it ran at.

`--count quick` runs each drill at the count of `make test-slow` (5 SIGKILLs of each save
loop, 2 crash-and-rejoins, ...), `--count N` N rounds of each (the random-moment save
drills want a kill inside a save, which one or two rounds may miss), and `--only EXPR` the
tests whose names match (pytest's -k): to try the script in minutes. None of them writes
RESULTS.md, whose table is of the full counts; the full run takes hours on 2 cores, and
the host drills need root (network namespaces) and etcd-server (make install-launchers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from results_md import replace_section

ROOT = Path(__file__).resolve().parent.parent
BAD_INPUT = "tests/config/test_bad_input.py"
"""Malformed input, every case: one row of its own."""


@dataclass(frozen=True)
class Fault:
    """A kind of fault, as its test injects it and checks what survived.

    what: the fault (`{case}` is replaced by the case's id).
    promise: what the test asserts when it has recovered.
    steps_lost: training steps lost (or run again) when the case passes; "-" where nothing
        trains.
    updates: updates (gradients, pushes, records) lost or applied twice when it passes.
    recovery: the time to recover the test asserts, or how it is bounded.
    per_case: faults injected by one case, one round.
    rounds: (quick, full) rounds of a soak drill (tests/support/soak.py), as its test
        declares them: per_case is injected each round.
    measured: reads a figure the test prints (seconds to recover) from its output.
    """

    what: str
    promise: str
    steps_lost: str
    updates: str
    recovery: str
    per_case: int = 1
    rounds: tuple[int, int] | None = None
    measured: Callable[[str], str] | None = None


def _seconds(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"measured: median {ordered[len(ordered) // 2]:.1f} s, longest {ordered[-1]:.1f} s "
            f"over {len(ordered)}")


def _lost_host_stop(output: str) -> str:
    """test_multihost's `host A stopped 7.3s after B was killed: ...`."""
    found = [float(x) for x in re.findall(r"stopped ([\d.]+)s after", output)]
    return _seconds(found) if found else ""


def _survivors_next_step(output: str) -> str:
    """test_host_loss's `survivors' next step after each kill: [2.9, 3.1] s`."""
    found = re.search(r"survivors' next step after each kill: \[([^\]]*)\] s", output)
    values = [float(x) for x in found.group(1).split(",") if x.strip()] if found else []
    return _seconds(values) if values else ""


def _steps_with_the_leader_down(output: str) -> str:
    """test_etcd's `... step time median 0.031s, longest 1.204s`."""
    found = re.search(r"step time median ([\d.]+)s, longest ([\d.]+)s", output)
    return (f"measured: longest step {float(found.group(2)):.2f} s (median "
            f"{float(found.group(1)):.3f} s)") if found else ""


WEIGHTS = "none: final weights = one uninterrupted process"
AVERAGED = "none: weights = one process averaging the slices that took part"
NO_TRAINING = "-"
ENDS = "- (the job ends: detection, not recovery)"


def _save_drill(what: str, promise: str) -> Fault:
    """A drill of SIGKILLs at random moments of saving, TRIALS of them (tests/faults/
    test_faults.py: 5, 50 under make soak)."""
    return Fault(what, promise, NO_TRAINING, "no checkpoint lost", "the next save",
                 rounds=(5, 50))


FAULTS: dict[str, Fault] = {
    # ------------------------------------------------------------ restarts, one machine
    "tests/faults/test_faults.py::test_a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted":
        Fault("SIGKILL of rank 1 as step 5 begins, `--max-restarts 1` ({case})",
              "every rank restarted and resumed from step 4's checkpoint",
              "0 (step 5 run again)", WEIGHTS, "a restart and a resume (not bounded)"),
    "tests/faults/test_faults.py::test_a_kill_in_the_middle_of_a_save_restarts_from_the_checkpoint_before":
        Fault("SIGKILL of rank 1 inside the save of step 2 (its file written, not published)",
              "restarted from scratch: nothing was published", "0 (steps 1-2 run again)",
              WEIGHTS, "a restart (not bounded)"),
    "tests/faults/test_faults.py::test_a_stalled_or_diverging_rank_is_named_and_nothing_is_left":
        Fault("rank 1 SIGSTOPped, or calling another collective ({case})",
              "rank 0 names rank 1 and the collective; exit non-zero; no process or shared "
              "memory left", ENDS, NO_TRAINING,
              "named at the collective timeout (3 s here); the job ends within 60 s"),
    "tests/faults/test_faults.py::test_a_stalled_rank_is_failed_within_seconds_not_at_the_collective_timeout":
        Fault("rank 1 SIGSTOPped while the collective timeout is 120 s",
              "its launcher kills it once stopped for DTRAIN_STALL_TIMEOUT (2 s here, 5 s "
              "by default) and the job ends naming it", ENDS, NO_TRAINING,
              "the job ends within 22 s of its start, not at the 120 s timeout"),
    "tests/faults/test_faults.py::test_ranks_die_with_a_killed_launcher":
        Fault("SIGKILL of `dtrain run` itself", "its ranks die with it", ENDS, NO_TRAINING,
              "within 10 s"),
    "tests/faults/test_faults.py::test_dtrain_train_goes_on_when_a_parameter_server_with_a_backup_is_killed":
        Fault("`dtrain train`, `[ps] copies = 2`: server 0 SIGKILLed as step 3's pushes "
              "reach it", "the backup copies take its shards over; exit 0, no restart", "0",
              "none: each push applied once; weights = one process",
              "at once (its sockets close)"),
    # ------------------------------------------------------------------ saves
    "tests/faults/test_faults.py::test_sigkill_at_random_moments_of_saving_never_loses_the_newest_checkpoint":
        _save_drill("SIGKILL at a random moment of a loop of blocking saves",
                    "the newest listed checkpoint opens (checksums) with its step's values; "
                    "the steps never go back"),
    "tests/checkpoint/test_background_save.py::test_sigkill_at_random_moments_of_background_saving_never_loses_the_newest":
        _save_drill("SIGKILL at a random moment of a loop of background saves while training",
                    "the newest listed checkpoint opens with its step's values; the steps "
                    "never go back"),
    "tests/checkpoint/test_checkpoint_copies.py::test_sigkill_at_random_moments_of_replicated_saving_never_loses_the_newest":
        _save_drill("SIGKILL at a random moment of a three-host job's loop of saves with "
                    "`checkpoint.copies = 1` (blocking and background in turn)",
                    "the newest checkpoint the hosts list and hold whole opens, every file "
                    "verified, with its step's values; the steps never go back; the next "
                    "job resumes it"),
    "tests/checkpoint/test_background_save.py::test_a_kill_inside_a_background_write_keeps_the_previous_checkpoint":
        Fault("SIGKILL in the background writer of step 2 (its file written, not published)",
              "step 1 stays the newest and loads; the half-written folder is ignored, then "
              "swept", NO_TRAINING, "no checkpoint lost", "the next save"),
    "tests/faults/test_faults.py::test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous":
        Fault("file-size limit below the checkpoint's size (EFBIG, as a full disk)",
              "one error line; the checkpoint before is kept and loads", ENDS,
              "no checkpoint lost", "-"),
    "tests/checkpoint/test_background_save.py::test_a_full_disk_during_a_background_write_keeps_the_previous":
        Fault("no space left during a background write",
              "wait() raises the line naming the checkpoint before, which loads", ENDS,
              "no checkpoint lost", "-"),
    "tests/checkpoint/test_background_save.py::test_ranks_in_threads_save_together_and_fail_together":
        Fault("one rank's background write fails ({case})",
              "every rank's wait() raises its line; the checkpoint before stays the newest",
              ENDS, "no checkpoint lost", "-"),
    "tests/checkpoint/test_background_save.py::test_a_rank_that_never_writes_fails_the_save_after_the_timeout":
        Fault("rank 1 never writes its part of a background save",
              "rank 0's wait() names it; nothing is left behind", ENDS, "no checkpoint lost",
              "the group's timeout"),
    "tests/checkpoint/test_fallback.py::test_dtrain_train_resume_falls_back_and_equals_a_resume_from_the_good_one":
        Fault("the newest checkpoint damaged ({case}) before `dtrain train --resume`",
              "one line says so; it is moved under damaged/ and the run resumes from the "
              "one before", "2 (steps 3-4 run again)",
              "none: losses and weights = a resume from the checkpoint before", "at resume"),
    "tests/checkpoint/test_fallback.py::test_a_restart_after_a_damaged_save_resumes_from_the_good_one":
        Fault("a byte of the newest checkpoint flipped, then rank 1 stalled and killed, "
              "`--max-restarts 1`", "the restart resumes from the checkpoint before by "
              "itself, saying so", "2 (steps 3-4 run again)",
              "none: weights = a resume from the checkpoint before",
              "the stall timeout and a restart"),
    "tests/checkpoint/test_fallback.py::test_a_hosts_damaged_copy_is_replaced_by_the_good_one":
        Fault("a host's copy of a file damaged (`checkpoint.copies = 1`, 3 hosts)",
              "replaced by another host's good copy; every rank resumes", "0",
              "no checkpoint lost", "at resume"),
    "tests/checkpoint/test_fallback.py::test_a_copy_that_arrives_wrong_is_asked_of_the_next_holder":
        Fault("a checkpoint file sent with a byte flipped (`checkpoint.copies = 2`, 3 hosts)",
              "refused and fetched from the next holder; with none good, one line on every "
              "rank naming each holder's answer", "0", "no checkpoint lost", "at resume"),
    # ------------------------------------------------------------ machines
    "tests/checkpoint/test_live_copies.py::test_dtrain_train_live_replicas_copy_checkpoints_and_resume_from_either_host":
        Fault("live replicas on two hosts with disks of their own (`checkpoint.copies = "
              "1`): host A's folder lost", "the job resumes on both hosts from step 4; both "
              "disks hold the new checkpoints", "0",
              "none: weights = one process resumed from step 4", "at resume"),
    "tests/launch/test_multihost.py::test_a_lost_host_is_named":
        Fault("two hosts (network namespaces), host {case} after the checkpoint of step 2",
              "the other's launcher names the lost node in one line, exits non-zero, leaves "
              "no process", ENDS, NO_TRAINING,
              "under 12 s (heartbeat grace 5 s; the collective timeout 15 s)",
              measured=_lost_host_stop),
    "tests/launch/test_multihost.py::test_both_hosts_restart_and_resume_when_the_link_comes_back":
        Fault("the link between two hosts cut, then restored, `--max-restarts 1`",
              "both restart and resume from the newest checkpoint; both exit 0",
              "0 (resumed from step 2's checkpoint)", "none: the run ends at its last step",
              "the link's return, then a restart"),
    "tests/launch/test_multihost.py::test_a_host_restarted_after_a_crash_rejoins_and_resumes":
        Fault("host B SIGKILLed and started again, in a row in one job",
              "it joins the next round each time and the job resumes; exit 0",
              "0 (each round resumed from the newest checkpoint)",
              "none: the run ends at its last step", "a restart (not bounded)",
              rounds=(2, 20)),
    "tests/launch/test_multihost.py::test_a_hosts_lost_folder_is_refilled_from_the_copies_bit_for_bit":
        Fault("a host's checkpoint folder deleted before a resume (no shared filesystem, "
              "`checkpoint.copies = 1`)",
              "refilled from the copies; the resume equals an undisturbed one bit for bit",
              "0", "none: weights, optimizer and RNG states bit for bit", "-"),
    "tests/checkpoint/test_checkpoint_copies.py::test_a_lost_hosts_folder_is_refilled_from_the_copies":
        Fault("one of three hosts' checkpoint folders deleted (`checkpoint.copies = 1`, in "
              "one process per host)", "every rank resumes its own files from the copies",
              "0", "no checkpoint lost", "-"),
    # ------------------------------------------------------------ elastic rounds
    "tests/ft/test_elastic.py::test_an_elastic_job_goes_from_4_to_2_to_3_ranks_as_one_process_would":
        Fault("elastic job (`--nnodes 1:3`, the default store): a 2-rank node SIGKILLed for "
              "good, then a 1-rank node joins",
              "4 -> 2 -> 3 ranks, each round re-laid out and resumed from the newest "
              "checkpoint", "0", "none: every step's loss and the final weights = one "
                                 "process", "a new round (not bounded)", per_case=2),
    "tests/launch/test_elastic_etcd.py::test_an_elastic_job_on_etcd_goes_from_2_to_1_to_2_nodes_as_one_process_would":
        Fault("elastic job on etcd (`--nnodes 1:3 --rdzv-backend etcd`): a node SIGKILLed "
              "for good, then another joins",
              "2 -> 1 -> 2 nodes, rounds met in etcd, each resumed from the newest "
              "checkpoint", "0", "none: every step's loss and the final weights = one "
                                 "process", "a new round (not bounded)", per_case=2),
    # ------------------------------------------------------------ live replicas
    "tests/ft/test_live.py::test_survivors_of_a_killed_replica_go_on_and_match_one_process":
        Fault("live replica 2 exits {case} step 3",
              "the others go on at once, no restart", "0", AVERAGED,
              "within the step"),
    "tests/ft/test_live.py::test_a_replacement_recovers_from_a_live_peer_and_the_group_grows_back":
        Fault("a killed live replica's replacement started",
              "sent the state by a live peer; weights, optimizer state and step identical",
              "0", AVERAGED, "its start-up and a state transfer"),
    "tests/ft/test_live.py::test_a_stopped_replica_is_dropped_within_the_step_timeout_and_rejoins":
        Fault("live replica 2 SIGSTOPped, then continued",
              "dropped; rejoins as a replacement and ends identical", "0", AVERAGED,
              "a step at most the step timeout (2 s here) + 1.5 s longer"),
    "tests/ft/test_live.py::test_replicas_of_two_ranks_lose_and_regain_a_whole_replica":
        Fault("live replicas of two ranks ({case}): a rank of one killed",
              "its whole live replica dropped; two fresh ranks rejoin, each sent its "
              "position's state; identical to their peers bit for bit", "0", AVERAGED,
              "within the step"),
    "tests/ft/test_live.py::test_the_first_replica_finds_one_whose_weights_differ":
        Fault("a live replica's weights changed by 1e-6 in one element",
              "the first live replica's digest comparison names it", "-",
              "found at the next comparison", "-"),
    "tests/ft/test_live.py::test_dtrain_train_drops_a_killed_replica_and_takes_its_replacement_back":
        Fault("`dtrain train` live replicas: live replica 2 SIGKILLed, `--max-restarts 1`",
              "3 -> 2 -> 3 live replicas, no other process restarted",
              "0", "none: one record per step, none lost or repeated",
              "within the step (heartbeat 2 s, step timeout 5 s)"),
    "tests/ft/test_live.py::test_dtrain_train_replicas_of_two_ranks_lose_and_regain_one":
        Fault("`dtrain train` live replicas of two ranks ({case}): rank 3 SIGKILLed, "
              "`--max-restarts 1`", "2 -> 1 -> 2 live replicas, both ranks started again",
              "0", "none: one record per step, none lost or repeated",
              "within the step (heartbeat 2 s, step timeout 5 s)"),
    "tests/ft/test_live.py::test_the_step_a_killed_first_replica_applied_is_recorded_by_the_next":
        Fault("`dtrain train` live replicas: live replica 0, the writer, SIGKILLed after "
              "applying step 5 and before recording it",
              "the next writer records step 5", "0",
              "none: every step recorded once, in order", "within the step"),
    "tests/ft/test_live_metrics.py::test_a_stalled_writers_late_record_goes_in_step_order":
        Fault("`dtrain train` live replicas: live replica 0, the writer, SIGSTOPped after "
              "applying step 5 and before recording it, continued steps later",
              "the next writer records step 5; the late record goes beside it, in step "
              "order; replica 0 rejoins", "0",
              "none lost; step 5 recorded by both writers", "within the step"),
    "tests/ft/test_live.py::test_a_lost_machine_is_named_and_its_replacement_recovers_the_live_state":
        Fault("a live job of 2 machines (loopback, {case}): one SIGKILLed whole, then "
              "replaced", "named in one line; the same command takes the place and its live "
              "replica holds the same weights at every rank", "0",
              "none: the same weights at every position", "its start-up and a state transfer"),
    "tests/ft/test_host_loss.py::test_losing_any_host_rank_0s_first_loses_no_step":
        Fault("live replicas on etcd, 3 hosts (network namespaces): a whole host SIGKILLed "
              "(launcher, ranks, etcd member), rank 0's first, then each in turn, and "
              "started again", "the survivors go on without a restart, checkpoints go on; "
              "the replacement takes the lost place; every live replica ends with the same "
              "weights", "0", "none: every step recorded once",
              "the survivors' next step (not bounded)", rounds=(1, 20),
              measured=_survivors_next_step),
    # ------------------------------------------------------------ the store
    "tests/store/test_etcd.py::test_killing_the_etcd_leader_mid_run_loses_no_step":
        Fault("live replicas on etcd: the etcd leader SIGKILLed mid-run, then restarted",
              "the run goes on and ends well, no live replica dropped", "0",
              "none: every step averaged over all 3 live replicas",
              "about one election (request timeout 1 s)", rounds=(1, 10),
              measured=_steps_with_the_leader_down),
    "tests/store/test_etcd.py::test_gloo_groups_form_on_it_and_its_calls_survive_the_leaders_loss":
        Fault("the etcd leader SIGKILLed under a store client",
              "its calls go on through another member", NO_TRAINING, "none: no call lost",
              "about one election"),
    # ------------------------------------------------------------ the parameter server
    "tests/ps/test_ps.py::test_a_silent_worker_is_dropped_and_the_others_finish":
        Fault("a worker falls silent (ssp)", "the server drops it; the others finish",
              "0 for the others", "the silent worker's later pushes",
              "worker_timeout (2 s here)"),
    "tests/ps/test_ps.py::test_a_killed_server_restarts_from_its_snapshot":
        Fault("a parameter server SIGKILLed, `copies = 1`, and started again",
              "its successor loads its snapshot; training goes on, momentum included",
              "0 (a snapshot every step here)", "none since the snapshot",
              "its start-up"),
    "tests/ps/test_ps.py::test_dtrain_run_starts_servers_and_survives_a_killed_worker":
        Fault("`dtrain run --servers`: worker 1 SIGKILLed at step 10 (async)",
              "the server drops it; worker 0 finishes; exit 0", "0 for the others",
              "the dead worker's", "worker_timeout"),
    "tests/ps/test_ps.py::test_a_killed_server_loses_no_push_with_a_backup":
        Fault("a parameter server SIGKILLed mid-run, `[ps] copies = 2`",
              "its backup takes the shard over; = one process", "0",
              "none: every push applied exactly once", "at once (its sockets close)"),
    "tests/ps/test_ps.py::test_a_stopped_server_is_left_for_its_backup_after_the_heartbeat_timeout":
        Fault("a parameter server SIGSTOPped mid-run (a machine that stopped answering), "
              "`[ps] copies = 2`", "its backup takes the shard over; = one process", "0",
              "none: every push applied exactly once", "within the 10 s heartbeat"),
    "tests/ps/test_ps.py::test_a_push_in_flight_when_its_server_dies_is_applied_once":
        Fault("a parameter server SIGKILLed with a push in flight (point {case}), "
              "`[ps] copies = 2`", "the push resent with its id; = one process", "0",
              "none: applied once, the duplicate dropped", "at once (its sockets close)"),
    "tests/ps/test_ps.py::test_dtrain_run_survives_a_killed_server_with_a_backup":
        Fault("`dtrain run --servers 2`: server 0 SIGKILLed mid-run, copies {case}",
              "copies 2: exit 0, the backup serving; copies 1: the job fails naming the "
              "server", "0 with a backup", "none with a backup: 28 pushes each applied once",
              "at once (its sockets close)"),
    "tests/ps/test_replacement.py::test_a_killed_server_is_replaced_and_the_next_death_survived":
        Fault("a parameter server SIGKILLed after step 2 and replaced, then another after "
              "step 5 ({case})", "a new server takes the slot and joins every chain; the "
              "run survives the next death", "0",
              "none: every push applied once on every copy; = one process",
              "the new server's start-up", per_case=2),
    "tests/ps/test_replacement.py::test_servers_killed_in_turn_are_replaced_every_time":
        Fault("a parameter server of 3 (2 copies) SIGKILLed every 2 steps, each slot in "
              "turn, each replaced", "replaced each time once the chains are whole", "0",
              "none: every push applied once on every copy; = one process",
              "the new server's start-up", rounds=(4, 20)),
    "tests/ps/test_replacement.py::test_a_lost_machine_is_replaced_on_another_and_the_next_loss_survived":
        Fault("a parameter server's machine lost (link cut, processes killed) after step 2, "
              "replaced on a spare; then another's after step 5 (copies {case})",
              "a server on the spare machine takes the slot; the run survives the next loss",
              "0", "none: every push applied once on every copy; = one process",
              "the new server's start-up", per_case=2),
    # ------------------------------------------------------------ exits
    "tests/launch/test_exit.py::test_pipeline_example_exits_cleanly_every_time_with_native_collectives":
        Fault("`dtrain run -n 2 examples/pipeline.py`, native collectives, ranks pinned to "
              "one CPU (the shutdown race amplified)", "exit 0, no `terminate called`",
              NO_TRAINING, NO_TRAINING, "-", rounds=(15, 100)),
    # ------------------------------------------------------------ other checks
    "tests/faults/test_faults.py::test_a_jobs_sockets_listen_on_loopback_only":
        Fault("a job's listening sockets inspected", "all bound to 127.0.0.1", NO_TRAINING,
              NO_TRAINING, "-"),
    "tests/faults/test_faults.py::test_no_source_can_unpickle_what_it_receives":
        Fault("the sources searched for unpickling", "none found", NO_TRAINING, NO_TRAINING,
              "-"),
}
"""Each fault test, by its pytest id (file::function), in the table's order."""


def soak_drills(makefile: Path = ROOT / "Makefile") -> list[str]:
    """The tests `make soak` runs (its SOAK variable), which must each have a row here."""
    text = makefile.read_text()
    found = re.search(r"^SOAK\s*:=\s*((?:.*\\\n)*.*)$", text, re.MULTILINE)
    if found is None:
        raise SystemExit("benchmarks/fault_results.py: no SOAK := ... in the Makefile")
    return found.group(1).replace("\\\n", " ").split()


@dataclass
class Case:
    """One case of a test, as the JUnit report has it."""

    case_id: str
    result: str  # passed | failure: message | error: message | skipped: reason
    output: str  # what it printed (figures some tests measure)


FULL, QUICK = "full", "quick"
"""The counts: `make soak`'s, or `make test-slow`'s (DTRAIN_SOAK_ROUNDS unset); else a
number of rounds."""


def rounds_of(fault: Fault, count: str) -> int:
    """Rounds of `fault`'s drill at `count` (1 for a test that is no drill)."""
    if fault.rounds is None:
        return 1
    quick, full = fault.rounds
    return full if count == FULL else quick if count == QUICK else int(count)


def run(report: Path, count: str, only: str | None) -> float:
    """pytest on every test of FAULTS and the malformed-input suite (slow cases included),
    the drills at `count`; the JUnit report, with each case's output, into `report`.
    Returns the minutes it took."""
    start = time.monotonic()
    selection = ["-k", only] if only else []
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_SOAK_ROUNDS"}
    if count != QUICK:
        env["DTRAIN_SOAK_ROUNDS"] = count
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not gpu", "-p",
                    "no:cacheprovider", "-o", "junit_logging=system-out",
                    f"--junitxml={report}", *selection, *FAULTS, BAD_INPUT], cwd=ROOT, env=env)
    return (time.monotonic() - start) / 60


def outcomes(report: Path) -> dict[str, list[Case]]:
    """file::function -> its cases."""
    found: dict[str, list[Case]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name, _, case_id = case.get("name", "").partition("[")
        path = case.get("classname", "").replace(".", "/") + ".py"
        result = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or "").strip().splitlines() or [""]
                result = f"{tag}: {message[0][:100]}"
        output = "".join(node.text or "" for node in case.iter("system-out"))
        found.setdefault(f"{path}::{name}", []).append(
            Case(case_id.rstrip("]"), result, output))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(found: dict[str, list[Case]], count: str,
         only: str | None) -> tuple[list[str], int, int]:
    """The table's rows (one per fault; those `only` left out, none), the faults injected
    and the faults recovered."""
    lines, injected, recovered = [], 0, 0
    for test, fault in FAULTS.items():
        cases = found.get(test, [])
        if only and not cases:
            continue
        ran = [c for c in cases if not c.result.startswith("skipped")]
        skipped = [c for c in cases if c.result.startswith("skipped")]
        each = fault.per_case * rounds_of(fault, count)
        ok = [c for c in ran if c.result == "passed"]
        injected += each * len(ran)
        recovered += each * len(ok)
        ids = [c.case_id for c in cases if c.case_id]
        what = fault.what.replace("{case}", ", ".join(ids) or "-")
        name = test.rpartition("/")[2]
        if not cases:
            state = "not run"
        elif skipped and not ran:
            state = f"skipped: {skipped[0].result.partition(': ')[2]}"
        else:
            state = f"{each * len(ok)}/{each * len(ran)}: {fault.promise}"
            state += f" ({len(skipped)} skipped)" if skipped else ""
        failed = [c.result for c in ran if c.result != "passed"]
        good = bool(ran) and not failed
        recovery = fault.recovery
        figure = fault.measured("\n".join(c.output for c in ok)) if fault.measured else ""
        if figure:
            recovery += f"; {figure}"
        lines.append("| " + " | ".join(_cell(x) for x in [
            what, f"`{name}`", str(each * len(ran)), state,
            fault.steps_lost if good else "-" if not ran else "see failures",
            fault.updates if good else "-" if not ran else "see failures",
            recovery]) + " |")
        lines += [f"|  | {_cell(f)} |  |  |  |  |  |" for f in failed[:3]]
    return lines, injected, recovered


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def command(count: str, only: str | None, write: bool) -> str:
    """The command line that made a table."""
    words = ["python", "benchmarks/fault_results.py"]
    words += ["--count", count] if count != FULL else []
    words += ["--only", only] if only else []
    return shlex.join(words + (["--write"] if write else []))


def section(found: dict[str, list[Case]], minutes: float, count: str, only: str | None,
            write: bool) -> list[str]:
    table, injected, recovered = rows(found, count, only)
    counts = {FULL: "the soak drills at the counts of `make soak`",
              QUICK: "the soak drills at the counts of `make test-slow`, not of `make soak`"
              }.get(count, f"each soak drill {count} round(s), not the counts of `make soak`")
    lines = [
        "## Faults injected, and what survived them",
        "",
        f"Command: `{command(count, only, write)}`, on "
        f"{datetime.date.today().isoformat()} at commit {_commit()} (`git rev-parse HEAD`): "
        f"each test below with its slow cases, {counts}, and the malformed-input suite; "
        f"{minutes:.0f} min on {os.cpu_count()} cores.  ",
        "A case passed only if its fault was recovered from as promised: the steps lost and "
        "the updates lost or doubled are what the test checks then (its final weights against "
        "one process, one record per step, each push applied once). The time to recover is "
        "the bound the test asserts, and the figure it measured where it prints one.",
        "",
        "| fault | test | faults injected | recovered as promised | steps lost | updates "
        "lost or doubled | time to recover |",
        "|---|---|---|---|---|---|---|",
        *table,
    ]
    bad = [c for test, cases in found.items() if test.startswith(BAD_INPUT) for c in cases]
    passed = sum(c.result == "passed" for c in bad)
    if bad or not only:
        lines.append(
            f"| malformed input (configs, flags, data paths, checkpoints, parameter-server "
            f"messages, pickle bombs) | `{BAD_INPUT.rpartition('/')[2]}` | {len(bad)} | "
            f"{passed}/{len(bad)}: one clear line and exit 2, or a rejected message and a "
            "live server | - | - | at once |")
    lines += [
        "",
        f"Totals, without malformed input: {injected} faults injected, {recovered} recovered "
        "as promised.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="replace the section in RESULTS.md (full counts only)")
    parser.add_argument("--count", default=FULL, metavar="N|quick",
                        help="run each soak drill N rounds, or at make test-slow's counts, "
                             "instead of make soak's")
    parser.add_argument("--only", default=None, metavar="EXPR",
                        help="run only the tests whose names match (pytest -k EXPR)")
    args = parser.parse_args()
    mistake = ""
    if args.count not in (FULL, QUICK) and not (args.count.isdigit() and int(args.count) > 0):
        mistake = f"--count {args.count!r}: give a number of rounds (1 or more) or 'quick'"
    elif args.write and (args.count != FULL or args.only):
        mistake = "--write puts the full run in RESULTS.md: drop --count and --only"
    elif missing := [t for t in soak_drills() if t not in FAULTS]:
        mistake = f"make soak runs {', '.join(missing)}, which has no row in FAULTS"
    if mistake:
        print(f"fault_results: error: {mistake}", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "faults.xml"
        minutes = run(report, args.count, args.only)
        found = outcomes(report)
    lines = section(found, minutes, args.count, args.only, args.write)
    print("\n".join(lines))
    if not args.only and (unknown := [t for t in FAULTS if t not in found]):
        print(f"fault_results: warning: no case ran for {', '.join(unknown)}", file=sys.stderr)
    if args.write:
        replace_section("faults", lines)


if __name__ == "__main__":
    main()
