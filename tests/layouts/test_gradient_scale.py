"""Every axis that divides gradients divides them right, and the comparison with one process
sees it when it does not: negative controls.

Each case trains `dtrain train`'s Trainer two steps of plain SGD without a clip, in a
layout whose gradients an axis divides or sums (dp; dp x cp; the experts over ep and over
the ranks holding the same experts; ep folded over tp, each tp rank sending its share of
the tokens; ZeRO's shards; tp's replicated parameters under sequence parallelism; a
pipeline's tied embedding), and compares every step's loss and
gradient norm (before any clip) with one process on the same global batch: equal. Then
the same case with that divisor changed on purpose, inside the ranks (a patch of the one
place that applies it): the comparison fails. A test of "equals one process" that trained
with Adam and a clip would pass both (Adam's update is blind to a gradient's scale); these
show the comparison the layout tests make cannot. docs/development.md lists them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dtrain.testing import run_ranks

GPT = {"arch": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}
MOE = {"arch": "llama", "preset": "moe-tiny", "n_layer": 2, "block_size": 16}
STEPS = 2


def _config(model: dict, parallel: dict, folder: str) -> dict:
    return {"model": model, "data": {"max_bytes": 40_000},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0,
                          "grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": STEPS, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
                      "out_dir": folder},
            "logging": {"sample_tokens": 0, "log_every": 100,
                        "metrics": f"{folder}/metrics.jsonl"},
            "checkpoint": {"background": False},
            "parallel": {"nproc": 2, **parallel}}


CASES: dict[str, tuple[dict, dict]] = {
    "dp": (GPT, {}),
    "dp x cp": (GPT, {"cp": 2}),
    "ep": (MOE, {"ep": 2}),
    "edp (ZeRO)": (MOE, {"ep": 2, "zero": 2}),
    "ep folded over tp": (MOE, {"tp": 2, "ep": 2}),
    "ZeRO shards": (GPT, {"zero": 2}),
    "tp, replicated parameters": (GPT, {"tp": 2, "sequence_parallel": True}),
    "pp, tied embedding": (GPT, {"pp": 2, "microbatches": 2}),
}
"""Each axis that divides or sums gradients: the model and the `[parallel]` keys (2 ranks)."""


# ------------------------------------------------------------------ the wrong divisors
@contextlib.contextmanager
def _patched(owner: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _times_two_after_init(original: Callable) -> Callable:
    """DataParallel's divisor halved: it divides by one rank where there are two (dp, or dp
    x cp divided by dp alone)."""
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self._scale *= 2
    return init


def _experts_times_ep(original: Callable) -> Callable:
    """The experts' gradients in DataParallel divided as if each had not already summed
    the tokens its expert-parallel peers sent it (1/ep forgotten)."""
    def fill(self, bucket, i, param) -> None:
        original(self, bucket, i, param)
        if self._is_expert(param):
            bucket.slots[i].mul_(2)
    return fill


def _every_token_on_every_tp_rank(original: Callable) -> Callable:
    """ep folded over tp without the tp ranks' shares: each sends every token to the
    experts, whose gradients then count each token tp times."""
    def split(self, group, rank, size, tp_group=None, overlap_chunks=1) -> None:
        original(self, group, rank, size, None, overlap_chunks)
    return split


def _apart_times_two(original: Callable) -> Callable:
    """ZeRO's scale of the experts' shards (edp / the shard group) doubled."""
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        object.__setattr__(self, "apart_scale", self.apart_scale * 2)  # a frozen dataclass
    return init


def _units_times_two(original: Callable) -> Callable:
    """ZeRO's reduce-scatter summing where it averages over the shard group."""
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        object.__setattr__(self, "scale", self.scale * 2)  # (frozen or not)
    return init


def _skipped(original: Callable) -> Callable:
    def nothing(self, *args, **kwargs) -> None:
        return None
    return nothing


def _wrong(case: str) -> contextlib.AbstractContextManager:
    """The patch that divides (or sums) `case`'s gradients wrong, in this process."""
    from dtrain.data_parallel import DataParallel
    from dtrain.data_parallel.zero.units import Sharding, Unit
    from dtrain.models.moe import MoE
    from dtrain.pipeline.runtime import Pipeline
    from dtrain.tensor_parallel.summed import SumAtEnd

    return {
        "dp": lambda: _patched(DataParallel, "__init__", _times_two_after_init),
        "dp x cp": lambda: _patched(DataParallel, "__init__", _times_two_after_init),
        "ep": lambda: _patched(DataParallel, "_fill_slot", _experts_times_ep),
        "edp (ZeRO)": lambda: _patched(Sharding, "__init__", _apart_times_two),
        "ep folded over tp": lambda: _patched(MoE, "expert_parallel",
                                              _every_token_on_every_tp_rank),
        "ZeRO shards": lambda: _patched(Unit, "__init__", _units_times_two),
        "tp, replicated parameters": lambda: _patched(SumAtEnd, "finish", _skipped),
        "pp, tied embedding": lambda: _patched(Pipeline, "_sum_tied", _skipped),
    }[case]()


# ------------------------------------------------------------------ the runs
def _train(runs: list[tuple[str, dict, bool]]) -> dict[str, dict[str, list[float]]]:
    """Each run (name, config values, wrong?) trained by the Trainer on this process's
    world, the wrong ones with their case's divisor changed: each step's loss and gradient
    norm (rank 0's metrics)."""
    from dtrain.config import config_from_dict
    from dtrain.train.trainer import Trainer

    out = {}
    for name, values, wrong in runs:
        case = name.removesuffix(" (wrong)")
        with _wrong(case) if wrong else contextlib.nullcontext():
            Trainer(config_from_dict(values)).run()
        rows = [json.loads(line) for line in
                Path(values["logging"]["metrics"]).read_text().splitlines()]
        out[name] = {key: [r[key] for r in rows if "loss" in r] for key in ("loss", "grad_norm")}
    return out


@pytest.mark.timeout(240)
def test_every_divisor_is_right_and_a_wrong_one_is_seen(tmp_path: Path) -> None:
    one = {name: (name, _config(model, {"nproc": 1}, str(tmp_path / f"one-{name}")), False)
           for name, (model, _) in CASES.items() if name in ("dp", "ep")}
    reference = run_ranks(_train, 1, list(one.values()), timeout=100)[0]
    runs = [(name + (" (wrong)" if wrong else ""),
             _config(model, parallel, str(tmp_path / f"{name}-{wrong}".replace(" ", "_"))),
             wrong)
            for name, (model, parallel) in CASES.items() for wrong in (False, True)]
    got = run_ranks(_train, 2, runs, timeout=220)[0]
    for name, (model, _) in CASES.items():
        want = reference["ep" if model is MOE else "dp"]
        _assert_same_steps(got[name], want, name)
        with pytest.raises(AssertionError):  # the negative control: it must not pass
            _assert_same_steps(got[f"{name} (wrong)"], want, f"{name} (wrong)")


def _assert_same_steps(got: dict[str, list[float]], want: dict[str, list[float]],
                       name: str) -> None:
    """The comparison of the layout tests: every step's loss and gradient norm."""
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{name} {k}: {m}")
