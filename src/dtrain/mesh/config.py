"""The `[parallel]` section: how the model is laid out over the ranks. A job's Dims are made
from it (`Dims.of`), which is where the degrees are checked against the world.

    [parallel]  nproc = 2, dp = 0, tp = 1, pp = 1, zero = 0, schedule = "1f1b"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.mesh.dims import CpMethod, Exchange, Schedule
from dtrain.schema import non_negative, positive


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks: its degrees, the pipeline's schedule, and
    how gradients meet (among the ranks, or on parameter servers)."""

    nproc: int = positive(2)
    """Ranks started on this machine by `dtrain train` (ignored under another launcher)."""
    dp: int = non_negative(0)
    """Data-parallel degree; 0 means all ranks left after tp, cp and pp."""
    tp: int = positive(1)
    """Tensor-parallel degree: each layer's weights split across this many consecutive
    ranks (dtrain.tensor_parallel); data parallelism runs over the rest."""
    pp: int = positive(1)
    """Pipeline stages: the blocks cut into pp groups of consecutive layers on pp ranks,
    micro-batches flowing through them (dtrain.pipeline); the outermost axis of a sync
    group."""
    microbatches: int = positive(4)
    """With pp > 1: micro-batches each data-parallel rank's batch is cut into."""
    schedule: Schedule = "1f1b"
    """With pp > 1: gpipe, 1f1b, interleaved (needs virtual_stages >= 2), or a zero-bubble
    one, each backward split in the input's gradient and the weights', which fill the
    bubble: zb1p (ZB-H1), and on virtual_stages = 2 placed in a V, zbv (ZB-V) and
    dualpipev (DualPipeV, micro-batches >= 2 x pp)."""
    virtual_stages: int = positive(1)
    """Model chunks per pipeline rank (the interleaved schedule's v)."""
    stage_layers: str = ""
    """With pp > 1: the blocks of each stage. Empty: balanced by the blocks' parameters;
    "auto": the embedding's parameters counted on the first stage and the output head's
    on the last, so that a vocabulary-sized part weighs as the blocks it outweighs; or
    sizes in stage order, pp x virtual_stages of them adding up to the blocks ("2,3,3,2")."""
    overlap_pairs: Literal["auto", "on", "off"] = "auto"
    """With schedule = "dualpipev": compute each pair's backward in a second thread while
    its forward computes, the backward's collectives on twin process groups, so that one's
    communication runs under the other's compute. "auto": on CUDA devices (on CPU cores
    the two threads compete for the same cores)."""
    dp_replicate: int = positive(1)
    """Hybrid sharding (HSDP): the data-parallel ranks (dp of them) split into this many
    replicas of dp / dp_replicate ranks each; ZeRO shards the model state inside a replica
    (the ranks of one machine: fast links) and each shard's gradient is then averaged with
    the same shard of the other replicas (across machines: the fewest bytes on the slow
    links). Must divide dp; needs zero = 1, 2 or 3 (dtrain.mesh.dims: dp_replicate x
    dp_shard)."""
    zero: Literal[0, 1, 2, 3] = 0
    """Shard model state across the data-parallel ranks (dtrain.ZeRO): 1 optimizer state,
    2 and gradients, 3 and parameters; 0 replicates it (DataParallel)."""
    mixed_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """With zero > 0: compute and communicate in bf16 or fp16 over fp32 master weights
    (ZeRO's own option; DataParallel's is comm.grad_dtype)."""
    exchange: Exchange = "collective"
    """How gradients meet: collective (the ranks exchange them among themselves:
    DataParallel, ZeRO, tp, pp) or ps (parameter servers hold the model and its optimizer;
    nproc workers push gradients and pull parameters: dtrain.ps, tuned in [ps])."""
    ep: int = positive(1)
    """Expert-parallel degree: each mixture-of-experts layer's experts split over this many
    ranks, tokens sent to their experts' ranks and back by all-to-all. The MoE layers are
    laid out over the same ranks as the rest, folded over dp x cp x tp (which ep must
    divide), the innermost ranks first: tp's, then cp's, then dp's (dtrain.mesh.dims); the
    other layers keep their own layout."""
    ep_overlap_chunks: int = positive(1)
    """With ep > 1: cut each MoE layer's exchange into this many chunks (by the experts the
    tokens go to), so that one chunk's all-to-all runs while another's experts compute,
    and the shared experts compute during the first dispatch; forward and backward. 1 is
    one exchange each way, waited for at once. At most one chunk per expert a rank holds
    (more are as many as that)."""
    cp: int = positive(1)
    """Context-parallel degree: every sequence cut into 2 x cp chunks, each of cp ranks
    holding two (chunk i and its mirror 2cp-1-i, balanced for causal attention) through the
    whole model; attention meets the other chunks by `cp_method`. The model is replicated
    over cp, as over dp. dtrain's GPT and Llama, and Hugging Face models of the Llama
    family; model.block_size must divide by 2 x cp."""
    cp_method: CpMethod = "ring"
    """How attention meets the other ranks' chunks: ring (key/value blocks passed around
    while the local block computes), allgather (keys and values gathered once per layer:
    small with grouped-query attention) or alltoall (DeepSpeed-Ulysses: heads split over
    cp, which must divide each rank's query and key/value heads)."""
    sequence_parallel: bool = False
    """With tp > 1: run the norms, dropouts and residuals between the tensor-parallel
    layers on 1/tp of the sequence each (all-gather in, reduce-scatter out instead of an
    all-reduce; Korthikanti et al., 2022); dtrain's GPT and Llama. model.block_size must
    divide by tp."""

    @property
    def copy_ranks(self) -> int:
        """The ranks of one copy of the model laid out by these degrees: dp x cp x tp x pp,
        dp 1 where unset (a sync group's by default, and a live replica's)."""
        return max(self.dp, 1) * self.cp * self.tp * self.pp

    def check(self) -> None:
        """The rules between the section's own keys (the degrees against the world are
        `Dims.of`'s)."""
        if self.ep_overlap_chunks > 1 and self.ep == 1:
            raise ConfigError(f"parallel.ep_overlap_chunks = {self.ep_overlap_chunks} overlaps "
                              "expert parallelism's all-to-all with the experts' compute: set "
                              "parallel.ep > 1 (or ep_overlap_chunks = 1)")
        if self.dp_replicate > 1 and not self.zero:
            raise ConfigError(f"parallel.dp_replicate = {self.dp_replicate} shards the model "
                              "state inside each replica: set parallel.zero = 1, 2 or 3 (or "
                              "dp_replicate = 1: DataParallel replicates over every rank)")
        if self.mixed_precision != "fp32" and not self.zero:
            raise ConfigError(f"parallel.mixed_precision = {self.mixed_precision!r} needs "
                              "parallel.zero = 1, 2 or 3 (DataParallel takes comm.grad_dtype)")
