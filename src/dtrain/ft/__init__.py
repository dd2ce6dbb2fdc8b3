"""Fault tolerance in one home.

    env        the launcher<->rank contract: every DTRAIN_* variable (definitions layer)
    faults     fault injection for tests and drills (DTRAIN_FAULT)
    heartbeat  one Heartbeat: counters beaten in a store, silences noticed in seconds

This package imports none of its modules: its low-layer ones (env, faults, heartbeat) are
used by modules far below the rest of it, which must not load what sits above them.
"""
