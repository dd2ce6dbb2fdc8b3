"""dtrain.pipeline: layer-wise model parallelism with micro-batches that keep stages busy.

    mesh = dtrain.Mesh(pp=2)                                      # dp outside, if any
    pieces = pipeline.gpt_pieces(gpt, parts=mesh.size("pp"))      # or pipeline.split(seq, ...)
    mine = pipeline.pieces_for(pieces, mesh.group("pp"))
    pipe = pipeline.Pipeline(mine, mesh.group("pp"), microbatches=8, schedule="1f1b",
                             loss_fn=pipeline.gpt_loss_of(gpt),  # vocab-parallel under tp
                             tied=pipeline.tied_weights(gpt, mine, mesh.group("pp")))
    loss = pipe.step(x, y)            # every micro-batch's forward and backward
    optimizer.step()                  # over this rank's pieces

Partitioning (`partition`), schedules (`schedules`: GPipe, 1F1B, interleaved), the
messages between stages (`p2p`) and the executor (`runtime`) are separate modules.
"""

from dtrain.pipeline.gpt import (
    GPTPiece,
    gpt_loss,
    gpt_loss_of,
    gpt_pieces,
    release_others,
    tied_weights,
)
from dtrain.pipeline.partition import balanced_sizes, split, stage_sizes
from dtrain.pipeline.runtime import Pipeline, full_state_dict, pieces_for
from dtrain.pipeline.schedules import SCHEDULES, Action, build

__all__ = [
    "SCHEDULES", "Action", "GPTPiece", "Pipeline", "balanced_sizes", "build",
    "full_state_dict", "gpt_loss", "gpt_loss_of", "gpt_pieces", "pieces_for", "split",
    "release_others", "stage_sizes", "tied_weights",
]
