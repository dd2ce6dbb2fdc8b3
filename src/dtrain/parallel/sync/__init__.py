"""Synchronization over slow links: replicas that send less, or less often.

    compression  PowerSGD (low rank, error feedback) and int8 gradients, for DataParallel
    diloco       local SGD and DiLoCo: replicas step alone and average every H steps
                 (dtrain.layouts.synced wraps a Holding with it from outside)
"""
