"""The store keys of live replicas' rounds (dtrain.parallel.live), and their removal.

Each round of a quorum posts under `r/{round}/`: every replica's arrival (`a/{id}`), the
decision (`d`), the votes of each vote n of the round (`v{n}/{id}`) and their verdicts
(`c{n}`), a failure mark (`failed`) and the description of the state a live peer sends
(`state`). Left there, a run of a million steps would fill the job's store with tens of
millions of keys; so the first member of each committed round deletes those of the round
`KEEP` rounds before it, which no replica still reads: one that fell that far behind was
dropped long ago, and looks for the latest round when it comes back.
"""

from __future__ import annotations

import torch.distributed as dist

KEEP = 64


def forget(store: dist.Store, g: int, slots: int) -> None:
    """Delete round `g`'s keys (of replicas 0..slots-1) from `store`."""
    votes = 0
    while store.check([f"r/{g}/c{votes}"]):
        votes += 1
    keys = ["d", "failed", "state", *(f"a/{i}" for i in range(slots)),
            *(f"c{n}" for n in range(votes)),
            *(f"v{n}/{i}" for n in range(votes + 1) for i in range(slots))]
    for key in keys:
        store.delete_key(f"r/{g}/{key}")
