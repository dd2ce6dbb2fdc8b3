"""dtrain.pipeline: layer-wise model parallelism with micro-batches that keep stages busy.

    mesh = dtrain.Mesh(pp=2)                                      # dp outside, if any
    pieces = pipeline.cut(model, parts=mesh.size("pp"))        # or pipeline.split(seq, ...)
    mine = pipeline.pieces_for(pieces, mesh.group("pp"))
    pipe = pipeline.Pipeline(mine, mesh.group("pp"), microbatches=8, schedule="1f1b",
                             loss_fn=pipeline.loss_of(model),  # vocab-parallel under tp
                             tied=pipeline.tied_weights(model, mine, mesh.group("pp")))
    loss = pipe.step(x, y)            # every micro-batch's forward and backward
    optimizer.step()                  # over this rank's pieces

Partitioning (`partition`), schedules (`schedules`: GPipe, 1F1B, interleaved), the
messages between stages (`p2p`) and the executor (`runtime`) are separate modules.
"""

from dtrain.pipeline.partition import balanced_sizes, split, stage_sizes
from dtrain.pipeline.pieces import Piece, cut, extra_loss_of, lm_loss, loss_of, tied_weights
from dtrain.pipeline.runtime import Pipeline, full_state_dict, pieces_for
from dtrain.pipeline.schedules import SCHEDULES, Action, build

__all__ = [
    "SCHEDULES", "Action", "Piece", "Pipeline", "balanced_sizes", "build", "cut",
    "extra_loss_of", "full_state_dict", "lm_loss", "loss_of", "pieces_for", "split",
    "stage_sizes", "tied_weights",
]
