"""Where each of dtrain's tensors lives in a Hugging Face model folder (`HFName`): one
tensor of its own (its name), one tensor per expert (`Stacked`: dtrain stacks a MoE layer's
experts, the folders of Mixtral, Qwen3-MoE and DeepSeek-V3 keep them apart), or nowhere
(`Zeros`).
dtrain.models.convert names them; dtrain.models.weights reads them and the exporter
(dtrain.tools.export_hf) writes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacked:
    """A dtrain tensor (E, rows, cols) of E experts that Hugging Face's files keep as
    tensors of their own per expert: `parts` name patterns (with `{e}`, the expert's index)
    whose (rows_i, cols) tensors, concatenated along rows, make expert e's (rows, cols)
    (a fused gate and up projection has two parts)."""

    parts: tuple[str, ...]
    count: int

    def names(self) -> list[str]:
        """Every Hugging Face tensor name it covers, expert by expert."""
        return [part.format(e=e) for e in range(self.count) for part in self.parts]

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """dtrain's (E, rows, cols) tensor as the Hugging Face tensors (equal parts)."""
        return {part.format(e=e): piece.contiguous().clone()
                for e in range(self.count)
                for part, piece in zip(self.parts, tensor[e].chunk(len(self.parts)),
                                       strict=True)}


@dataclass(frozen=True)
class Zeros:
    """A dtrain tensor of `shape` that Hugging Face's format has no place for and that its
    model computes as zeros (a softmax router's unused balancing bias)."""

    shape: tuple[int, ...]


HFName = str | Stacked | Zeros
"""Where a dtrain tensor lives in a Hugging Face folder: one tensor's name, one per expert,
or nowhere (zeros)."""


def expert_places(model_type: str, layer: str, n_experts: int, shared: bool = False
                  ) -> dict[str, HFName]:
    """Where a MoE block's tensors (by their names under dtrain's MoE layer) live in a
    Mixtral (`model_type` "mixtral"), Qwen3-MoE ("qwen3_moe") or DeepSeek-V3
    ("deepseek_v3") folder, `layer` being the block's prefix there ("model.layers.3"):
    Mixtral's files keep each expert's w1 (gate), w3 (up) and w2 (down) under
    block_sparse_moe, the others their gate_proj, up_proj and down_proj under mlp. The
    balancing bias is DeepSeek-V3's e_score_correction_bias, and has no place in the others
    (a softmax router's is zeros); with `shared`, the shared experts are DeepSeek-V3's
    shared_experts."""
    if model_type == "mixtral":
        moe, gate_up, down = f"{layer}.block_sparse_moe", ("w1", "w3"), ("w2",)
    else:
        moe, gate_up, down = f"{layer}.mlp", ("gate_proj", "up_proj"), ("down_proj",)
    places: dict[str, HFName] = {
        "gate.weight": f"{moe}.gate.weight",
        "gate.expert_bias": Zeros((n_experts,)),
        "experts.gate_up_proj": Stacked(tuple(f"{moe}.experts.{{e}}.{w}.weight"
                                              for w in gate_up), n_experts),
        "experts.down_proj": Stacked(tuple(f"{moe}.experts.{{e}}.{w}.weight" for w in down),
                                     n_experts),
    }
    if model_type == "deepseek_v3":
        places["gate.expert_bias"] = f"{moe}.gate.e_score_correction_bias"
    if shared:
        places.update({f"shared.{ours}.weight": f"{moe}.shared_experts.{theirs}.weight"
                       for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"),
                                            ("down", "down_proj"))})
    return places
