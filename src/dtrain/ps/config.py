"""The `[ps]` section: the parameter servers of `parallel.exchange = "ps"`.

    [ps]  servers = 1, consistency = "ssp", staleness = 2, copies = 2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.schema import non_negative, positive


@dataclass
class PsConfig:
    """The parameter servers of parallel.exchange = "ps"."""

    servers: int = positive(1)
    """Server processes per machine; the parameters are split across them."""
    consistency: Literal["sync", "async", "ssp"] = "sync"
    """sync, async, or ssp (bounded staleness)."""
    staleness: int = non_negative(2)
    """With consistency = "ssp": how many steps a worker may run ahead of the slowest."""
    snapshot_every: int = non_negative(0)
    """Servers snapshot their shards to out_dir/ps-snapshots every this many updates (0:
    never); restarted servers resume from them."""
    copies: int = positive(1)
    """Copies of each shard, each on its own server (shard copies): with 2, a push is
    acknowledged once the backup has it too, and a server's death loses nothing (its
    backup takes over its shard). At most ps.servers."""

    def check(self) -> None:
        if self.copies > self.servers:
            raise ConfigError(f"ps.copies = {self.copies} is more than ps.servers = "
                              f"{self.servers}: each copy of a shard needs a server of its own")
