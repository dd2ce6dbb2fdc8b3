"""Optimizers: the `[optimizer]` section, the optimizer it makes, and its learning rate.

    config    OptimizerConfig: name, learning rate, decay, betas, warm-up, schedule, clip
    build     build_optimizer: the torch optimizer of a layout's parameters (for Muon, which
              of them are hidden matrices: muon_split)
    muon      Muon: Muon on the hidden matrices and AdamW on the rest, one optimizer
    schedule  lr_factor: linear warm-up, then cosine decay (or constant)
"""

from dtrain.optim.build import build_optimizer, decay_groups, muon_split
from dtrain.optim.config import OptimizerConfig
from dtrain.optim.muon import Muon
from dtrain.optim.schedule import lr_factor

__all__ = ["Muon", "OptimizerConfig", "build_optimizer", "decay_groups", "lr_factor",
           "muon_split"]
