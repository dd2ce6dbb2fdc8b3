"""The job's store: the key-value store every process of a job shares, and heartbeats in it.

    address    where the store is (node 0's TCPStore or an etcd cluster), `connect()` to
               it whichever it is, `prefixed()` views of it
    etcd       EtcdStore: a torch.distributed Store on an etcd cluster (no single point of
               failure)
    heartbeat  one Heartbeat: counters beaten in the store, silences noticed in seconds
"""

from dtrain.store.address import BACKENDS, StoreAddress, check_backend, connect, prefixed

__all__ = ["BACKENDS", "StoreAddress", "check_backend", "connect", "prefixed"]
