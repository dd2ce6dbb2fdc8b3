"""Run the fault suites (slow cases included) and put their outcomes in benchmarks/RESULTS.md.

    python benchmarks/fault_results.py --write

Runs the fault suites (SUITES below) with pytest (`-m "slow or not slow"`: every case)
and every soak drill at its full count (DTRAIN_SOAK_ROUNDS=full, as `make soak`: 20
crash-and-rejoins in a row, 50 SIGKILLs of each save loop), reads the JUnit report, and
writes one row
per fault: how many were injected, whether the run recovered as promised, and the data
lost (0 when the case passed: each asserts that the newest checkpoint loads and holds the
right values, or that the final weights equal an uninterrupted run's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from results_md import replace_section

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["tests/faults/test_faults.py", "tests/launch/test_multihost.py",
          "tests/ft/test_elastic.py", "tests/ft/test_live.py",
          "tests/checkpoint/test_background_save.py", "tests/config/test_bad_input.py",
          "tests/ft/test_host_loss.py", "tests/store/test_etcd.py",
          "tests/checkpoint/test_checkpoint_copies.py", "tests/ps/test_ps.py"]

# test function -> (the fault, faults per case, what "recovered" means)
FAULTS = {
    "test_a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted": (
        "SIGKILL of rank 1 at step 5, `--max-restarts 1`", 1,
        "restarted, resumed from step 4, final weights = one uninterrupted process"),
    "test_a_kill_in_the_middle_of_a_save_restarts_from_the_checkpoint_before": (
        "SIGKILL of rank 1 inside the save of step 2", 1,
        "restarted from scratch (nothing published), final weights = uninterrupted run"),
    "test_a_stalled_or_diverging_rank_is_named_and_nothing_is_left": (
        "SIGSTOP of rank 1, or rank 1 calls another collective", 1,
        "rank 0 names rank 1 and the collective within the 3 s timeout; exit non-zero; "
        "no process or shm segment left"),
    "test_sigkill_at_random_moments_of_saving_never_loses_the_newest_checkpoint": (
        "SIGKILL at a random moment of a save loop", 50,
        "the newest listed checkpoint loads, checksums and values right, every time"),
    "test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous": (
        "file-size limit below the checkpoint (EFBIG, as a full disk)", 1,
        "one error line; the previous checkpoint is kept and loads"),
    "test_a_jobs_sockets_listen_on_loopback_only": (
        "a job's listening sockets inspected", 1, "all bound to 127.0.0.1"),
    "test_no_source_can_unpickle_what_it_receives": (
        "grep of the sources for unpickling", 1, "none found"),
    "test_ranks_die_with_a_killed_launcher": (
        "SIGKILL of `dtrain run` itself", 1, "its ranks die within 10 s"),
    "test_a_stalled_rank_is_failed_within_seconds_not_at_the_collective_timeout": (
        "SIGSTOP of rank 1, the collective timeout 120 s", 1,
        "its launcher kills it after 2 s stopped (5 s unless set); the job ends naming it, "
        "well within 22 s"),
    "test_an_elastic_job_goes_from_4_to_2_to_3_ranks_as_one_process_would": (
        "elastic job (`--nnodes 1:3`): a 2-rank node SIGKILLed for good, then a 1-rank node "
        "joins", 2, "4 -> 2 -> 3 ranks, each round re-laid out; losses and weights = one "
        "process"),
    "test_survivors_of_a_killed_replica_go_on_and_match_one_process": (
        "live replicas: live replica 2 exits before or during backward", 1,
        "the others go on at once, no step lost; weights = one process averaging the slices "
        "that took part"),
    "test_a_replacement_recovers_from_a_live_peer_and_the_group_grows_back": (
        "live replicas: a killed live replica's replacement", 1,
        "recovered from a live peer; weights, optimizer state and step identical"),
    "test_a_stopped_replica_is_dropped_within_the_step_timeout_and_rejoins": (
        "live replicas: SIGSTOP of a live replica, then SIGCONT", 1,
        "dropped within the step timeout; rejoins as a replacement"),
    "test_dtrain_train_drops_a_killed_replica_and_takes_its_replacement_back": (
        "`dtrain train` live replicas: live replica 2 SIGKILLed, `--max-restarts 1`", 1,
        "3 -> 2 -> 3 live replicas, no step lost or repeated, no other process restarted"),
    "test_the_step_a_killed_first_replica_applied_is_recorded_by_the_next": (
        "`dtrain train` live replicas: live replica 0, the writer, SIGKILLed after applying "
        "step 5 and before recording it", 1,
        "the next writer records step 5; every step recorded once"),
    "test_sigkill_at_random_moments_of_background_saving_never_loses_the_newest": (
        "SIGKILL at a random moment of background saves", 50,
        "the newest listed checkpoint loads with its step's values, every time"),
    "test_losing_any_host_rank_0s_first_loses_no_step": (
        "live replicas on etcd, 3 hosts (network namespaces): a whole host SIGKILLed (its "
        "launcher, ranks and etcd member), rank 0's first, then each in turn, and started "
        "again", 20, "the survivors go on without a restart (their next step's delay "
        "measured, not bounded), no step lost or repeated, checkpoints written meanwhile; "
        "the replacement takes the lost place; at the end every live replica holds the same "
        "weights"),
    "test_killing_the_etcd_leader_mid_run_loses_no_step": (
        "live replicas on etcd: the etcd leader SIGKILLed mid-run, then restarted", 10,
        "no step lost, none averaged over fewer live replicas"),
    "test_gloo_groups_form_on_it_and_its_calls_survive_the_leaders_loss": (
        "the etcd leader SIGKILLed under a store client", 1,
        "its calls go on through another member, none lost"),
    "test_a_hosts_lost_folder_is_refilled_from_the_copies_bit_for_bit": (
        "a host's checkpoint folder deleted before resume (`checkpoint.copies = 1`, two "
        "hosts)", 1, "refilled from the copies; the resume equals an undisturbed one bit for "
        "bit"),
    "test_a_killed_server_loses_no_push_with_a_backup": (
        "a parameter server SIGKILLed mid-run, `[ps] copies = 2`", 1,
        "its backup takes the shard over; every push applied exactly once; = one process"),
    "test_a_push_in_flight_when_its_server_dies_is_applied_once": (
        "a parameter server SIGKILLed with a push in flight (before relaying it, or after "
        "its backup acknowledged it), `[ps] copies = 2`", 1,
        "the push resent with its id and applied once; duplicates dropped; = one process"),
    "test_dtrain_run_survives_a_killed_server_with_a_backup": (
        "`dtrain run --servers 2`: a server SIGKILLed mid-run (copies 2, then 1)", 1,
        "with a backup the job ends well, every push applied once; without, it fails naming "
        "the server"),
    "test_dtrain_train_goes_on_when_a_parameter_server_with_a_backup_is_killed": (
        "`dtrain train` with `[ps] copies = 2`: a server SIGKILLed as a push reaches it", 1,
        "no restart; every push applied once; final weights = one process"),
    "test_a_stopped_server_is_left_for_its_backup_after_the_heartbeat_timeout": (
        "a parameter server SIGSTOPped mid-run (a machine that stopped answering), "
        "`[ps] copies = 2`", 1,
        "its backup takes the shard over after the 10 s heartbeat; every push applied once; "
        "= one process"),
    "test_a_lost_machine_is_named_and_its_replacement_recovers_the_live_state": (
        "a live job of 2 machines (loopback): one SIGKILLed whole, then replaced (dense, and "
        "experts over ep = 2)", 1,
        "named in one line; a launcher with another -n refused; the same command takes the "
        "place; both live replicas then hold the same weights at every rank"),
    "test_the_first_replica_finds_one_whose_weights_differ": (
        "a live replica's weights changed by 1e-6 in one element", 1,
        "the first live replica's digest comparison names it"),
}
REJOINS = 20  # tests/launch/test_multihost.py's crash-and-rejoin, in a row
MULTIHOST = {  # tests/launch/test_multihost.py: two hosts in network namespaces, dp=4 over 2 x 2
    "test_a_lost_host_is_named": "a host lost after both trained to the checkpoint of step 2 "
                                 "({case}): the other stops within 12 s, naming the lost node",
    "test_both_hosts_restart_and_resume_when_the_link_comes_back":
        "link cut, then restored, `--max-restarts 1`: both hosts restart and resume",
    "test_a_host_restarted_after_a_crash_rejoins_and_resumes":
        "host B SIGKILLed and started again, 20 times in a row: it joins the next round and "
        "the job resumes",
}


def run(report: Path) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", "-p",
                    "no:cacheprovider", f"--junitxml={report}", *SUITES], cwd=ROOT,
                   env={**os.environ, "DTRAIN_SOAK_ROUNDS": "full"})
    return time.monotonic() - start


def outcomes(report: Path) -> dict[str, list[tuple[str, str]]]:
    """test function -> [(case id, passed | failed | skipped: reason)]."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for case in ET.parse(report).getroot().iter("testcase"):
        name, _, case_id = case.get("name", "").partition("[")
        module = case.get("classname", "").rpartition(".")[2]
        result = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                result = f"{tag}: {(node.get('message') or '').splitlines()[0][:80]}"
        found[f"{module}::{name}"].append((case_id.rstrip("]"), result))
    return found


def section(found: dict[str, list[tuple[str, str]]], seconds: float) -> list[str]:
    lines = [
        "## Faults injected, and what survived them",
        "",
        "Command: `python benchmarks/fault_results.py --write` (runs "
        f"{', '.join(SUITES)} with the slow cases and the soak drills at full count; "
        f"{seconds / 60:.0f} min on 2 cores).  ",
        "Data lost is 0 where a case passed: each asserts the newest checkpoint loads with "
        "the right values, or that the final weights equal an uninterrupted run's.",
        "",
        "| fault | cases | faults injected | recovered as promised | data lost |",
        "|---|---|---|---|---|",
    ]
    total = recovered = 0
    for key, cases in sorted(found.items()):
        name = key.partition("::")[2]
        if name not in FAULTS:
            continue
        fault, per_case, promise = FAULTS[name]
        ran = [c for c in cases if not c[1].startswith("skipped")]
        ok = [c for c in ran if c[1] == "passed"]
        total += per_case * len(ran)
        recovered += per_case * len(ok)
        ids = ", ".join(c[0] for c in cases if c[0]) or "-"
        skipped = [c[1] for c in cases if c[1].startswith("skipped")]
        note = f" ({len(skipped)} skipped: {skipped[0][9:]})" if skipped else ""
        lines.append(f"| {fault} | {ids}{note} | {per_case * len(ran)} | "
                     f"{per_case * len(ok)}/{per_case * len(ran)}: {promise} | "
                     f"{0 if ok == ran else 'see failures'} |")
    for key, cases in sorted(found.items()):
        name = key.partition("::")[2]
        for case_id, result in cases if name in MULTIHOST else ():
            what = MULTIHOST[name].format(case=case_id)
            injected = int(not result.startswith("skipped") and "no fault" not in what)
            injected *= REJOINS if "times in a row" in what else 1
            total += injected
            recovered += injected if result == "passed" else 0
            lines.append(f"| two hosts (network namespaces): {what} | {case_id or '-'} | "
                         f"{injected} | {result} | {0 if result == 'passed' else '-'} |")
    bad = [c for key, cases in found.items() if "test_bad_input" in key for c in cases]
    passed_bad = sum(result in ("passed", "xfailed") for _, result in bad)
    lines += [
        f"| malformed input (configs, flags, data paths, checkpoints, parameter-server "
        f"messages, pickle bombs) | {len(bad)} | {len(bad)} | {passed_bad}/{len(bad)}: one "
        "clear line and exit 2, or a rejected message and a live server | 0 |",
        "",
        f"Totals, without malformed input: {total} faults injected, {recovered} recovered as "
        "promised.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "faults.xml"
        seconds = run(report)
        lines = section(outcomes(report), seconds)
    print("\n".join(lines))
    if args.write:
        replace_section("faults", lines)


if __name__ == "__main__":
    main()
