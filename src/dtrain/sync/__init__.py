"""Synchronization over slow links: copies of the model that send less, or less often.

    config       the `[sync]` section, and what compression and sync groups work with
    compression  PowerSGD (low rank, error feedback) and int8 gradients, for DataParallel
    diloco       local SGD and DiLoCo: sync groups step alone and average every H steps
                 (a Holding runs it after its own step: dtrain.layouts.holding.sync_with)
"""
