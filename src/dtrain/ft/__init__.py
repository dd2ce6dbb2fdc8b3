"""Fault tolerance: who takes part in each step, and how a job goes on when a rank fails.

    membership  who takes part in a step, as the training loop asks it (Fixed, or live)
    elastic     an elastic job's layout for the ranks each round brings
    live        live replicas: a failed replica dropped within the step, a replacement
                taken back without a restart

It sits in one layer, above what it keeps alive. What it stands on lives below, each in a
package of its own: the job's store and heartbeats (dtrain.store), the environment
contract (dtrain.env), fault injection for drills (dtrain.faults).
"""
