"""The `[checkpoint]` section: when checkpoints are saved, how many are kept, where a run
resumes from, and copies on other hosts.

    [checkpoint]  every = 0, keep_last = 2, resume = "auto"
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.errors import ConfigError
from dtrain.schema import non_negative, positive


@dataclass
class CheckpointConfig:
    every: int = non_negative(0)
    """Save every this many steps; 0 saves only at the end."""
    keep_last: int = positive(2)
    """Keep this many most recent checkpoints."""
    resume: str = ""
    """Resume from a checkpoint: "auto" (the newest in train.out_dir/checkpoints, if any),
    or the path of a checkpoints folder or of one checkpoint in it, saved in any layout.
    Empty: start afresh (an elastic restart resumes as "auto")."""
    background: bool = True
    """Write the checkpoints saved every `every` steps from a background thread: the step's
    state is copied to CPU memory and training goes on while it is written, published
    atomically as a blocking save is. The last save of a run always blocks. false: every
    save blocks."""
    copies: int = non_negative(0)
    """Hosts without a shared filesystem: each host writes its ranks' files into its own
    `train.out_dir` and sends a copy to this many other hosts (checkpoint copies, at most
    the hosts minus one); resume and `dtrain export` then work with any `copies` hosts'
    folders lost. Under live replicas the replica that writes a checkpoint sends it whole
    to this many other hosts' replicas. 0: every host sees one shared `train.out_dir`."""


def check_config(checkpoint: CheckpointConfig, refused: dict[str, bool]) -> None:
    """Checkpoint copies on other hosts are written by the ranks that write a checkpoint
    together (or, under live replicas, sent by the one that writes it; parameter servers'
    snapshots are carried in each host's first worker's files); `refused` names each
    setting that keeps its own state apart (sync groups) and whether it is on.

    Raises:
        ConfigError: copies asked for with one of them.
    """
    k = checkpoint.copies
    for what, used in refused.items():
        if k and used:
            raise ConfigError(f"checkpoint.copies = {k} with {what} is not supported yet: "
                              "set checkpoint.copies = 0 and give the hosts a shared "
                              "train.out_dir")
