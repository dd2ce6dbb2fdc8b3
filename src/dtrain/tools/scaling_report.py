"""What `dtrain bench scaling` shows: its table rows, the printed table and the plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("strong", "weak")


@dataclass(frozen=True)
class Row:
    """One point of the table, and an entry of the --json rows."""

    mode: str
    workers: int
    global_batch: int
    threads_per_worker: int
    step_time_ms: float
    samples_per_s: float
    tokens_per_s: float
    speedup: float
    efficiency: float
    comm_share: float
    oversubscribed: bool
    steps_timed: int
    train_commands: list[str]



def print_table(rows: list[Row], machine: dict[str, Any]) -> None:
    """The rows under a header naming the cores, threads and backend."""
    threads = ", ".join(f"{r.threads_per_worker} with {r.workers}"
                        for r in {r.workers: r for r in rows}.values())
    print(f"# dtrain bench scaling: {machine['cores']} cores available, backend "
          f"{machine['backend']}, device {machine['device']}; torch threads per worker "
          f"(OMP_NUM_THREADS = max(1, cores // workers)): {threads} worker(s)")
    if machine["load_before"] >= machine["cores"] / 2:
        print(f"# load average {machine['load_before']:g} before the runs: other processes "
              "were using the cores, so the figures carry their noise")
    print(f"# {'workers':>7} {'mode':<6} {'batch':>6} {'step(ms)':>9} {'samples/s':>10} "
          f"{'speedup':>8} {'effic.':>7} {'comm%':>6}")
    for r in rows:
        mark = " *" if r.oversubscribed else ""
        print(f"  {r.workers:>7} {r.mode:<6} {r.global_batch:>6} {r.step_time_ms:>9.1f} "
              f"{r.samples_per_s:>10.1f} {r.speedup:>8.2f} {r.efficiency:>7.2f} "
              f"{100 * r.comm_share:>6.1f}{mark}")
    if any(r.oversubscribed for r in rows):
        print(f"# * more workers than the {machine['cores']} cores: the workers take turns on "
              "the cores, so these rows measure time-slicing, not added hardware: past the "
              "core count, more workers add no arithmetic per second")


def plot(rows: list[Row], machine: dict[str, Any], title: str, path: Path) -> None:
    """Speed-up (with the ideal line), efficiency and comm share against workers; the
    oversubscribed range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    counts = sorted({r.workers for r in rows})
    panels = (("speed-up", lambda r: r.speedup), ("efficiency", lambda r: r.efficiency),
              ("comm share of step time (%)", lambda r: 100 * r.comm_share))
    axes[0].plot(counts, [c / counts[0] for c in counts], "k--", label="ideal")
    axes[1].axhline(1.0, color="k", linestyle="--", label="ideal")
    for ax, (label, value) in zip(axes, panels, strict=True):
        for mode, marker in zip(MODES, "os", strict=True):
            mine = [r for r in rows if r.mode == mode]
            if mine:
                ax.plot([r.workers for r in mine], [value(r) for r in mine], marker=marker,
                        label=mode)
        if counts[-1] > machine["cores"]:
            ax.axvspan(machine["cores"] + 0.5, counts[-1], color="grey", alpha=0.15,
                       label="more workers than cores")
        ax.set(xlabel="workers", ylabel=label, xticks=counts)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{title}: {machine['cores']} cores available, {machine['backend']}, "
                 f"max(1, {machine['cores']} // workers) torch threads per worker")
    fig.savefig(path, dpi=100)
    plt.close(fig)
