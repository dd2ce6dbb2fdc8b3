"""Data-parallel strategies and what they share.

    data_parallel  DataParallel: every rank the whole model, gradients all-reduced
    zero           ZeRO stages 1-3: optimizer state, gradients and parameters sharded
    sync           over slow links: compressed gradients (PowerSGD, int8), local SGD, DiLoCo
    averaging      the hook by which they average over replicas that change (dtrain.ft)
    agreement      replicas that start identical: the same model checked, state broadcast
    clip           the one global gradient-norm clip over replicated, split and sharded parts
"""
