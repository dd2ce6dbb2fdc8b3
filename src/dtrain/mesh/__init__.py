"""The mesh: the one owner of a job's degrees, and the process groups they lay out.

    dims       Dims: every degree (sync, pp, dp_replicate, dp_shard, cp, tp, ep) and how
               each axis is used, validated once; the axes' names (Axis) and arithmetic
    groups     Mesh: this rank's process group over any axes, by name
    config     the `[parallel]` section, from which a job's Dims are made
"""

from dtrain.mesh.dims import AXES, EXPERT_AXES, FLATTENED, Axis, Dims, Grid
from dtrain.mesh.groups import Mesh

__all__ = ["AXES", "EXPERT_AXES", "FLATTENED", "Axis", "Dims", "Grid", "Mesh"]
