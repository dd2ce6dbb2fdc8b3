"""The store side of live replicas' rounds (dtrain.ft.live): waiting for keys,
gathering the posts of many ranks, and deleting a round's keys once nobody reads them.

Each round of a quorum posts under `r/{round}/`, per rank `{replica}.{position}` (the
position of the rank in its replica: 0 for a replica of one rank): its arrival (`a/...`),
the votes of each vote n of the round (`v{n}/...`) and the description of the state a live
peer sends that position (`state.{position}`); and once per round the decision (`d`), the
verdicts (`c{n}`) and a failure mark (`failed`). Left there, a run of a million steps would
fill the job's store with tens of millions of keys; so the first rank of each committed
round deletes those of the round `KEEP` rounds before it, which no replica still reads:
one that fell that far behind was dropped long ago, and looks for the latest round when it
comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from dtrain.errors import DtrainError
from dtrain.ft.membership import RunOver

KEEP = 64


class RunFinished(RunOver):
    """The other replicas finished the run while this one waited to (re)join."""


def rank_key(replica: int, position: int) -> str:
    """How a rank of a replica signs its posts in a round."""
    return f"{replica}.{position}"


def gather(store: dist.Store, key_of: Callable[[str], str], ranks: list[str],
           deadline: float, decided: str | None, alive: Callable[[str], bool] | None = None,
           until: Callable[[dict[str, str]], bool] | None = None) -> dict[str, str]:
    """The values of key_of(r) for those `ranks` that post one before the deadline (and
    while `alive(r)`, if given), or before `decided` exists (if given), or `until` says
    enough."""
    found: dict[str, str] = {}
    pending, pause = list(ranks), 0.0002
    while True:
        keys = [key_of(r) for r in pending]
        if pending and store.check(keys):
            found.update(zip(pending, (v.decode() for v in store.multi_get(keys)),
                             strict=True))
            return found
        for r in pending:
            if store.check([key_of(r)]):
                found[r] = store.get(key_of(r)).decode()
        pending = [r for r in pending if r not in found and (alive is None or alive(r))]
        if (not pending or time.monotonic() > deadline or (until and until(found))
                or (decided is not None and store.check([decided]))):
            return found
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def wait_key(store: dist.Store, key: str, deadline: float, who: str, g: int,
             waited: float) -> str:
    """The value of `key` once it exists.

    Raises:
        RunFinished: the run ended meanwhile (the key `finished`).
        DtrainError: the deadline passed (`who` could not join round `g` in `waited` s).
    """
    pause = 0.0002
    while not store.check([key]):
        if store.check(["finished"]):
            raise RunFinished(f"{who}: the other replicas finished the run before it could "
                              "rejoin")
        if time.monotonic() > deadline:
            raise DtrainError(
                f"{who}: no live replica decided round {g} within {waited:.0f}s: every "
                "replica is gone; restart the job from its last checkpoint")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return store.get(key).decode()


def forget(store: dist.Store, g: int, slots: int, positions: int) -> None:
    """Delete round `g`'s keys (of replicas 0..slots-1 of `positions` ranks) from `store`."""
    votes = 0
    while store.check([f"r/{g}/c{votes}"]):
        votes += 1
    ranks = [rank_key(i, p) for i in range(slots) for p in range(positions)]
    keys = ["d", "failed", *(f"state.{p}" for p in range(positions)),
            *(f"a/{r}" for r in ranks), *(f"c{n}" for n in range(votes)),
            *(f"v{n}/{r}" for n in range(votes + 1) for r in ranks)]
    for key in keys:
        store.delete_key(f"r/{g}/{key}")
