"""The optimizer `[optimizer]` names, over the parameters a layout gives it.

With `name = "muon"` the parameters split in two (`muon_split`): Muon trains the hidden
weight matrices, AdamW the rest, as Keller Jordan's and Moonlight's setups do. The rule,
read from the module so that it gives the same answer on a whole model, its
tensor-parallel form and each of its pipeline pieces:

- a matrix: a 2-D parameter that trains (norms, biases and 3-D expert stacks are not);
- not an embedding's weight (an nn.Embedding, or a layer with `num_embeddings` and
  `embedding_dim` as tensor parallelism's VocabParallelEmbedding), nor the output head
  (`get_output_embeddings()`, Hugging Face's convention), nor anything tied to them (one
  tensor);
- inside the model's repeated blocks (an element of an nn.ModuleList or nn.ModuleDict:
  transformer layers, and a pipeline piece's blocks) when it has any: what sits outside
  them is the input and output stem (embeddings, the head), which a pipeline piece holds
  without its model's `get_output_embeddings`.

`muon_exclude` and `muon_include` (name patterns) then move parameters either way. A
pipeline rank passes its pieces as one nn.ModuleList: each piece is split on its own,
under the whole model's names. Tensor-parallel blocks are found by their layers' `splits`
and `group` (`tensor_blocks`), for Muon to orthogonalize each matrix whole.

Every optimizer steps all its parameters at once (`step_kernel`), as torchtitan's do: on
CUDA torch's fused kernels (`fused=True`: AdamW's whole update, every parameter, in a few
kernel launches), elsewhere its multi-tensor path (`foreach=True`: one call per operation
over the list of parameters, not a loop of small ops per parameter). On a CPU in fp32 the
multi-tensor step is bit for bit the per-parameter one (tests/optim/test_fused_step.py),
so runs compared with one process are unchanged; CUDA's fused kernel rounds differently in
the last bits. The choice is made where the tensors the optimizer updates are known: here
for a layout's parameters, and again by ZeRO for its shard pieces (on the host under
optimizer offload). A choice a caller made (`foreach=False`, `fused=False`) is kept.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import nn

from dtrain import comm
from dtrain.errors import ConfigError, DtrainError
from dtrain.optim.config import OptimizerConfig
from dtrain.optim.muon import Block, Muon
from dtrain.split import Split


def decay_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases, norms), as in GPT-2 training."""
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(params: Iterable[nn.Parameter] | nn.Module, cfg: OptimizerConfig
                    ) -> torch.optim.Optimizer:
    """The configured optimizer (`[optimizer]`: name, lr, betas, momentum, weight_decay,
    Muon's keys) over `params`, or over a module's trainable parameters.

    Raises:
        DtrainError: Muon over bare parameters (its split reads the module).
        ConfigError: `muon_include` names a parameter that is not a matrix.
    """
    if cfg.name == "muon":
        if not isinstance(params, nn.Module):
            raise DtrainError("optimizer.name = \"muon\": build_optimizer needs the module, "
                              "not its parameters (which of them are hidden matrices is "
                              "read from the module's layers)")
        return build_muon(params, cfg)
    groups = decay_groups(params.parameters() if isinstance(params, nn.Module) else params,
                          cfg.weight_decay)
    betas = cast(tuple[float, float], tuple(cfg.betas))  # two: OptimizerConfig.check
    kernel = step_kernel(device_of(p for g in groups for p in g["params"]))
    if cfg.name == "sgd":
        return steps_follow_params(torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                                                   **kernel))
    optimizer = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return steps_follow_params(optimizer(groups, lr=cfg.lr, betas=betas, **kernel))


StepKernel = dict[str, bool]
"""An optimizer's `foreach` or `fused` option, as its constructor takes it ({}: torch's
default)."""


def device_of(params: Iterable[torch.Tensor]) -> torch.device | None:
    """The one device `params` are on; None for none, several, or the meta device (a
    module built in split form, allocated later)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device.type == "meta" else device


def step_kernel(device: torch.device | None) -> StepKernel:
    """How an optimizer steps parameters on `device` all at once: {"fused": True} on CUDA,
    {"foreach": True} on any other device, {} when it is not known (see the module
    docstring)."""
    if device is None:
        return {}
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def with_step_kernel(options: dict[str, Any], optimizer: type[torch.optim.Optimizer],
                     device: torch.device | None) -> dict[str, Any]:
    """`options` (a parameter group's, or an optimizer's defaults) with `step_kernel(device)`
    in place of their `foreach` and `fused`, where `optimizer` takes them and `options`
    did not turn either off (False: a caller's choice, kept)."""
    kernel = step_kernel(device)
    taken = inspect.signature(optimizer).parameters
    if not kernel or options.get("foreach") is False or options.get("fused") is False \
            or not all(key in taken for key in ("foreach", "fused")):
        return options
    return {**options, "foreach": kernel.get("foreach"), "fused": kernel.get("fused")}


Built = TypeVar("Built", bound=torch.optim.Optimizer)


def steps_follow_params(optimizer: Built) -> Built:
    """`optimizer`, its step counts moved onto their parameter's device before each step
    where a group steps by fused kernels, which read them there (torch makes them there;
    a checkpoint's restored count, dtrain.layouts.parts, is a host scalar). Returns it."""
    def before_step(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in opt.param_groups:
            for p in group["params"] if group.get("fused") else []:
                count = opt.state.get(p, {}).get("step")
                if isinstance(count, torch.Tensor) and count.device != p.device:
                    opt.state[p]["step"] = count.to(p.device)

    optimizer.register_step_pre_hook(before_step)
    return optimizer


def build_muon(module: nn.Module, cfg: OptimizerConfig) -> Muon:
    """`Muon` over `module`'s trainable parameters as `muon_split` divides them: one Muon
    group (at muon_lr, or lr), and AdamW's two of `decay_groups` (at lr)."""
    matrices, rest = muon_split(module, cfg.muon_exclude, cfg.muon_include)
    a, b, c = cfg.muon_ns_coefficients  # three: OptimizerConfig.check
    beta1, beta2 = cfg.betas
    groups = [{"params": matrices, "muon": True, "lr": cfg.muon_lr or cfg.lr},
              *({**g, "muon": False} for g in decay_groups(rest, cfg.weight_decay))]
    muon = Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, ns_coefficients=(a, b, c), eps=cfg.muon_eps,
                ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr,
                ns_dtype=getattr(torch, cfg.muon_ns_dtype), betas=(beta1, beta2),
                blocks=tensor_blocks(module), **step_kernel(device_of(rest)))
    return steps_follow_params(muon)


def muon_split(module: nn.Module, exclude: Iterable[str] = (), include: Iterable[str] = ()
               ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the parameters Muon trains, those AdamW trains) of `module`'s trainable ones, by
    the rule of the module docstring; a parameter any of whose names (a tied one has
    several) matches an `exclude` pattern goes to AdamW, an `include` one to Muon. An
    nn.ModuleList or nn.ModuleDict given whole is a pipeline rank's pieces: each is split
    on its own, under its own names (the whole model's).

    Raises:
        ConfigError: an `include` pattern matches a parameter that is not 2-D.
    """
    exclude, include = list(exclude), list(include)
    parts = list(module.children()) if isinstance(module, nn.ModuleList | nn.ModuleDict) \
        else [module]
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    seen: set[int] = set()
    for part in parts:
        aliases: dict[int, list[str]] = {}  # a tied parameter has several names
        for name, p in part.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        hidden = hidden_matrices(part)
        for name, p in part.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            forced = _matches(aliases[id(p)], include)
            if forced and p.dim() != 2:
                raise ConfigError(f"optimizer.muon_include = {include} matches {name} of "
                                  f"shape {tuple(p.shape)}: Muon trains matrices (2-D "
                                  "parameters) only; narrow the pattern")
            if forced or (id(p) in hidden and not _matches(aliases[id(p)], exclude)):
                muon.append(p)
            else:
                adamw.append(p)
    return muon, adamw


def _matches(names: list[str], patterns: list[str]) -> bool:
    """Whether any of a parameter's `names` matches any of the fnmatch `patterns`."""
    return any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in patterns)


def hidden_matrices(module: nn.Module) -> set[int]:
    """Ids of `module`'s hidden weight matrices, by the rule of the module docstring."""
    stem = {id(m.weight) for m in module.modules() if _is_embedding(m)}
    head = getattr(module, "get_output_embeddings", None)
    output = head() if callable(head) else None
    if isinstance(output, nn.Module):
        stem |= {id(p) for p in output.parameters()}
    repeated = [m for c in module.modules() if isinstance(c, nn.ModuleList | nn.ModuleDict)
                for m in c.children()]
    held = {id(p) for m in repeated for p in m.parameters()} if repeated else None
    return {id(p) for p in module.parameters() if p.dim() == 2 and id(p) not in stem
            and (held is None or id(p) in held)}


def _is_embedding(module: nn.Module) -> bool:
    """An embedding table: nn.Embedding, or a layer that says it is one (a
    VocabParallelEmbedding, a user's) by its `num_embeddings` and `embedding_dim`."""
    return isinstance(module, nn.Embedding) or (
        hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim")
        and isinstance(getattr(module, "weight", None), nn.Parameter))


@runtime_checkable
class SplitLayer(Protocol):
    """A tensor-parallel layer (dtrain.tensor_parallel's): how each of its parameters is
    cut (`splits`, by attribute name) over which ranks (`group`)."""

    splits: Mapping[str, Split]
    group: comm.Group


def tensor_blocks(module: nn.Module) -> dict[int, Block]:
    """id(parameter) -> its Block, for each tensor-parallel block in `module` (none
    without tensor parallelism)."""
    found = {}
    for layer in module.modules():
        if isinstance(layer, SplitLayer):
            for name, split in layer.splits.items():
                p = getattr(layer, name, None)
                if isinstance(p, nn.Parameter):
                    found[id(p)] = Block(split, layer.group)
    return found
