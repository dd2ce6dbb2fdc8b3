"""dtrain's own collective algorithms, over any Group's point-to-point sends.

    ring              reduce-scatter and all-gather around a ring (bandwidth-optimal)
    tree              binomial-tree reduce and broadcast (latency-optimal for small ones)
    halving_doubling  recursive halving then doubling (Rabenseifner)
    hierarchical      shared memory inside each host, the network between hosts
"""
