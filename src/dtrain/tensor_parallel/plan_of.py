"""Which tensor-parallel plan a model takes: the one given, or its family's ready plan.

| model                                  | plan                      |
|----------------------------------------|---------------------------|
| dtrain's GPT                           | plans.gpt_plan            |
| dtrain's Llama                         | plans.llama_plan          |
| Hugging Face Llama, Mistral, Qwen2     | hf_plans.hf_plan          |
| Hugging Face GPT-2                     | hf_plans.hf_plan          |
| anything else                          | `[model] tp_plan`         |

A model whose code counts whole heads somewhere its layers do not tell (GPT-2's fused
QKV split) defines `after_split(tp_size)`, called once its layers are split.

Sequence parallelism (`[parallel] sequence_parallel`, dtrain.tensor_parallel.sequence)
is for dtrain's GPT and Llama only: Hugging Face models reshape by their input's length.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain import comm
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT
from dtrain.models.hf import HFCausalLM
from dtrain.models.llama import Llama
from dtrain.tensor_parallel.hf_plans import hf_plan
from dtrain.tensor_parallel.parallelize import Style, parallelize
from dtrain.tensor_parallel.plans import gpt_plan, llama_plan
from dtrain.tensor_parallel.sequence import apply_sequence_parallel


def plan_of(model: nn.Module, given: dict[str, Any] | None = None) -> dict[str, Style | str]:
    """`given` when there is one, else the ready plan of `model`'s family.

    Raises:
        ConfigError: no plan given and none known for the model.
    """
    if given:
        return dict(given)
    if isinstance(model, GPT):
        return gpt_plan(model.cfg)
    if isinstance(model, Llama):
        return llama_plan(model.cfg)
    if isinstance(model, HFCausalLM):
        return hf_plan(model)
    raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan: pass one with "
                      "[model] tp_plan = {\"layers.*.fc\" = \"colwise\", \"layers.*.proj\" = "
                      "\"rowwise\", ...}")


def check_sequence_parallel(model: nn.Module) -> None:
    """Raises ConfigError unless `model` is one sequence parallelism works with: dtrain's
    GPT or Llama (a Hugging Face model reshapes by its input's length)."""
    if not isinstance(model, (GPT, Llama)):
        raise ConfigError(f"parallel.sequence_parallel works with model.arch = \"gpt\" or "
                          f"\"llama\" only, not {type(model).__name__} (Hugging Face models "
                          "reshape by their input's length): set parallel.sequence_parallel "
                          "= false")


def split_model(model: nn.Module, group: comm.GroupLike, given: dict[str, Any] | None = None,
                sequence_parallel: bool = False, algorithm: str = "auto") -> nn.Module:
    """Split `model`'s layers across the tensor-parallel `group` by `plan_of(model, given)`,
    then let the model fix what counts whole heads (`after_split`).

    `sequence_parallel`: also run the activations between the split layers on each rank's
    1/tp of the sequence (`apply_sequence_parallel`). `algorithm`: the dtrain.comm
    algorithm of the layers' collectives.

    Raises:
        ConfigError: no plan for the model (`plan_of`), a plan that does not fit it
            (`parallelize`), or sequence parallelism asked of a model other than dtrain's
            GPT or Llama.
    """
    if sequence_parallel:
        check_sequence_parallel(model)
    parallelize(model, plan_of(model, given), group, algorithm)
    after = getattr(model, "after_split", None)
    if after is not None:
        after(comm.resolve(group).size)
    if sequence_parallel:
        apply_sequence_parallel(model, group, algorithm)
    return model
