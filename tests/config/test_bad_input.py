"""Bad input, one row each: a malformed config, flag, data path or checkpoint gets one clear
`dtrain: error:` line and a non-zero exit, and a malformed parameter-server message gets
refused while the server goes on serving; never a traceback, never a hang.

Most rows call the CLI's `main` in this process: they must fail before anything starts
ranks or trains, which the `cli` fixture forbids (a row that gets that far fails). The
data rows have to reach the corpus, which ranks read, so they run as `dtrain train`
processes, all at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import pickle
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import zmq

from dtrain import ps
from dtrain.checkpoint import universal
from dtrain.cli import main
from dtrain.config import load_config
from dtrain.launch import runner
from dtrain.tools import comm_bench
from dtrain.train import trainer
from tests.support.cli import dtrain, one_error_line

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> Callable[..., tuple[int, str]]:
    """`cli(*argv)`: run `dtrain ARGV` here, in tmp_path (`{tmp}` in an argument names it);
    returns (exit code, the one error line)."""
    monkeypatch.chdir(tmp_path)
    for name in ("TORCH_CPP_LOG_LEVEL", "DTRAIN_USER_CPP_LOG_LEVEL", "DTRAIN_DEBUG",
                 "DTRAIN_BACKEND"):
        monkeypatch.delenv(name, raising=False)  # main sets them; restored afterwards

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("this input was accepted: dtrain would start ranks or train")

    monkeypatch.setattr(runner, "run_agent", refuse)
    monkeypatch.setattr(trainer, "train", refuse)
    monkeypatch.setattr(comm_bench, "bench", refuse)
    (tmp_path / "hello.py").write_text("print('hello')\n")
    gpt2 = tmp_path / "gpt2"  # a Hugging Face model outside the Llama family
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32,
                                                   "n_head": 2, "n_layer": 1,
                                                   "vocab_size": 256, "n_positions": 64}))

    def run(*argv: str) -> tuple[int, str]:
        argv = tuple(a.format(tmp=tmp_path) for a in argv)
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, one_error_line(subprocess.CompletedProcess(argv, code, out, err))

    return run


# ---------------------------------------------------------------------------------- configs
# (TOML file or None, arguments after `dtrain train [FILE]`, part of the error line, exit code)
MOE = ["--set", "model.arch='llama'", "--set", "model.preset='moe-tiny'"]
"""dtrain's Llama with 8 experts per MoE block (moe-tiny)."""

CONFIGS = [
    pytest.param("[train]\nstepz = 3\n", [], "unknown key 'train.stepz' (did you mean "
                 "'train.steps'?)", 2, id="unknown-key"),
    pytest.param(None, ["--set", "train.stepz=3"], "did you mean 'train.steps'", 2,
                 id="unknown-key-set"),
    pytest.param("[trian]\nsteps = 3\n", [], "unknown section [trian] (did you mean 'train'?)",
                 2, id="unknown-section"),
    pytest.param("[parallel]\nsync_every = 10\n", [], "parallel.sync_every moved to sync.every",
                 2, id="moved-key"),
    pytest.param(None, ["--set", "parallel.bucket_mb=5"],
                 "--set: parallel.bucket_mb moved to comm.bucket_mb", 2, id="moved-key-set"),
    pytest.param("fault_tolerance = 'live'\n", [],
                 "'fault_tolerance' is a section: write its keys under [fault_tolerance]", 2,
                 id="section-as-key"),
    pytest.param("[sync]\neveri = 3\n", [], "unknown key 'sync.everi' (did you mean "
                 "'sync.every'?)", 2, id="unknown-key-new-section"),
    pytest.param(None, ["--set", "sync.every='ten'"], "sync.every = 'ten' must be int, not str",
                 2, id="wrong-type-new-section"),
    pytest.param(None, ["--set", "bogus.key=3"], "unknown section [bogus]", 2,
                 id="unknown-section-set"),
    pytest.param("steps = 3\n", [], "key 'steps' is outside any [section]: put it under "
                 "[train]", 2, id="key-outside-section"),
    pytest.param(None, ["--set", "train.steps"], "is not section.key=value", 2,
                 id="set-without-value"),
    pytest.param("[train]\nsteps = 'ten'\n", [], "train.steps = 'ten' must be int, not str", 2,
                 id="string-for-int"),
    pytest.param("[optimizer]\nlr = [0.1]\n", [], "optimizer.lr = [0.1] must be float, not list",
                 2, id="list-for-float"),
    pytest.param("[model]\nn_layer = 2.5\n", [], "model.n_layer = 2.5 must be int, not float", 2,
                 id="float-for-int"),
    pytest.param(None, ["--set", "train.steps=true"], "must be int, not bool", 2,
                 id="bool-for-int"),
    pytest.param("[data]\npath = 5\n", [], "data.path = 5 must be str, not int", 2,
                 id="int-for-string"),
    pytest.param("[optimizer]\nbetas = 0.9\n", [], "optimizer.betas = 0.9 must be a list", 2,
                 id="float-for-list"),
    pytest.param(None, ["--set", "optimizer.betas=[0.9]"], "two numbers", 2,
                 id="betas-one-number"),
    pytest.param(None, ["--set", "optimizer.betas=[1.5, 0.9]"], "two numbers in [0, 1)", 2,
                 id="betas-out-of-range"),
    pytest.param("[optimizer]\nlr = nan\n", [], "optimizer.lr = nan must be a finite number", 2,
                 id="nan-lr"),
    pytest.param("[train]\nsteps = 0\n", [], "train.steps = 0 must be positive", 2,
                 id="zero-steps"),
    pytest.param(None, ["--set", "train.steps=-5"], "train.steps = -5 must be positive", 2,
                 id="negative-steps"),
    pytest.param("[optimizer]\nlr = -0.1\n", [], "optimizer.lr = -0.1 must be positive", 2,
                 id="negative-lr"),
    pytest.param(None, ["--set", "train.batch_size=0"], "train.batch_size = 0 must be positive",
                 2, id="zero-batch"),
    pytest.param(None, ["--set", "model.dropout=1.5"], "model.dropout = 1.5 must be below 1", 2,
                 id="dropout-above-one"),
    pytest.param(None, ["--set", "data.val_fraction=0"], "data.val_fraction = 0.0 must be "
                 "between 0 and 1", 2, id="no-held-out-data"),
    pytest.param(None, ["--set", "train.batch_size=15"], "make it a multiple of 2", 2,
                 id="batch-not-split-by-ranks"),
    pytest.param(None, ["--set", "parallel.dp=3"], "make the product equal 2", 2,
                 id="dp-not-world-size"),
    pytest.param("[parallel]\npp = 3\n", [], "tp*pp = 1*3 = 3 does not divide the world size 2",
                 2, id="pp-not-dividing-world"),
    pytest.param(None, ["--set", "parallel.tp=4"], "does not divide the world size 2", 2,
                 id="tp-not-dividing-world"),
    pytest.param(None, ["--set", "parallel.tp=3"], "parallel.tp = 3 does not divide "
                 "model.n_head = 4", 2, id="tp-not-dividing-heads"),
    pytest.param("[model]\nn_head = 3\nn_embd = 48\n[parallel]\ntp = 2\n", [],
                 "parallel.tp = 2 does not divide model.n_head = 3", 2,
                 id="tp-not-dividing-heads-file"),
    pytest.param(None, ["--set", "model.vocab_size=257", "--set", "model.n_head=2", "--set",
                        "parallel.tp=2"], "parallel.tp = 2 does not divide model.vocab_size "
                 "= 257", 2, id="tp-not-dividing-vocab"),
    pytest.param(None, ["--set", "model.n_head=3"], "model.n_head = 3 does not divide "
                 "model.n_embd = 128", 2, id="heads-not-dividing-width"),
    pytest.param(None, ["--set", "parallel.zero=4"], "must be one of 0, 1, 2, 3", 2,
                 id="zero-stage-4"),
    pytest.param(None, ["--set", "parallel.mixed_precision='bf16'"], "needs parallel.zero", 2,
                 id="mixed-precision-without-zero"),
    pytest.param(None, ["--set", "parallel.tp=2", "--set", "parallel.zero=2", "--set",
                        "parallel.mixed_precision='fp16'"], "use \"bf16\"", 2,
                 id="fp16-with-tp"),
    pytest.param(None, ["--set", "parallel.exchange='ps'", "--set", "parallel.tp=2"],
                 "set parallel.tp = 2 back to the default", 2, id="ps-with-tp"),
    pytest.param(None, ["--set", "ps.servers=2", "--set", "ps.copies=3"],
                 "ps.copies = 3 is more than ps.servers = 2", 2, id="ps-replicas-over-servers"),
    pytest.param(None, ["--set", "ps.consistency='eventual'"],
                 "must be one of sync, async, ssp", 2, id="unknown-consistency"),
    pytest.param(None, ["--set", "parallel.pp=8"], "= 8 stages but the model has 4 layers", 2,
                 id="more-stages-than-layers"),
    pytest.param(None, ["--set", "parallel.pp=2", "--set", "model.n_layer=2", "--set",
                        "parallel.schedule='interleaved'"], "needs at least 2 chunks", 2,
                 id="interleaved-one-chunk"),
    pytest.param(None, ["--set", "parallel.pp=2", "--set", "model.n_layer=2", "--set",
                        "parallel.microbatches=3"],
                 "1 data-parallel rank x 3 micro-batches: make it a multiple of 3", 2,
                 id="microbatches-not-splitting-batch"),
    pytest.param(None, ["--set", "parallel.sequence_parallel=true"],
                 "parallel.sequence_parallel needs parallel.tp > 1", 2, id="sp-without-tp"),
    pytest.param(None, ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true",
                        "--set", "model.block_size=33"], "model.block_size = 33 does not "
                 "divide by parallel.tp = 2", 2, id="sp-sequence-not-divisible"),
    pytest.param(None, ["--set", "memory.recompute_modules=['blocks.*.atn']"],
                 "'blocks.*.atn' names no module of the model", 2, id="recompute-no-module"),
    pytest.param(None, ["--set", "memory.offload='optimizer'"],
                 "memory.offload = 'optimizer' needs parallel.zero = 1, 2 or 3", 2,
                 id="offload-without-zero"),
    pytest.param(None, ["--set", "memory.recompute='some'"],
                 "must be one of none, full, selective", 2, id="recompute-unknown-mode"),
    pytest.param(None, [*MOE, "--set", "parallel.ep=3", "-n", "3"],
                 "parallel.ep = 3 does not divide model.n_experts = 8", 2,
                 id="ep-not-dividing-experts"),
    pytest.param(None, [*MOE, "--set", "parallel.ep=4"],
                 "parallel.ep = 4 does not divide the ranks it is folded over (dp x cp x tp "
                 "= 2 x 1 x 1 = 2): choose an ep that divides 2", 2,
                 id="ep-not-dividing-dp"),
    pytest.param(None, [*MOE, "--set", "model.experts_per_token=9"],
                 "model.experts_per_token = 9 must lie in [1, model.n_experts = 8]", 2,
                 id="top-k-above-experts"),
    pytest.param(None, [*MOE, "--set", "parallel.ep=2", "--set", "parallel.exchange='ps'"],
                 "parallel.exchange = \"ps\" trains whole copies of the model on the workers, "
                 "with parameter servers holding it: set parallel.ep = 2 back to the default",
                 2, id="ep-with-ps"),
    pytest.param(None, ["--set", "model.n_experts=8"], "model.n_experts is a mixture-of-experts "
                 "key, which only model.arch = \"llama\" has (not 'gpt')", 2, id="moe-on-gpt"),
    pytest.param(None, [*MOE, "--set", "model.capacity_factor=-0.5"],
                 "model.capacity_factor = -0.5 must not be negative", 2,
                 id="negative-capacity"),
    pytest.param(None, ["--set", "parallel.ep=2"], "parallel.ep = 2 splits experts, and this "
                 "model has none", 2, id="ep-without-experts"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "model.block_size=30"],
                 "parallel.cp = 2 cuts each sequence into 2 x cp = 4 chunks, and "
                 "model.block_size = 30 does not divide by 4", 2, id="cp-not-dividing-block"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "parallel.exchange='ps'"],
                 "parallel.exchange = \"ps\" trains whole copies of the model on the workers, "
                 "with parameter servers holding it: set parallel.cp = 2 back to the default",
                 2, id="cp-with-ps"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "parallel.cp_method='alltoall'",
                        "--set", "model.n_head=3", "--set", "model.n_embd=48"],
                 "parallel.cp_method = \"alltoall\" splits each rank's 3 query and 3 "
                 "key/value heads over cp = 2", 2, id="alltoall-heads"),
    pytest.param(None, [*MOE, "--set", "parallel.cp=2", "--set", "model.capacity_factor=1.0"],
                 "parallel.cp = 2 with model.capacity_factor or model.aux_loss_weight: both "
                 "are per whole sequence", 2, id="cp-with-moe-capacity"),
    pytest.param(None, [*MOE, "--set", "parallel.ep=2", "--set", "comm.compression='int8'"],
                 "parallel.ep > 1 with comm.compression is not supported yet", 2,
                 id="ep-with-compression"),
    pytest.param(None, [*MOE, "--set", "parallel.tp=2", "--set",
                        "parallel.sequence_parallel=true", "--set", "model.capacity_factor=1.0"],
                 "parallel.sequence_parallel with model.capacity_factor or "
                 "model.aux_loss_weight: both are per whole sequence", 2,
                 id="sp-with-moe-capacity"),
    pytest.param(None, [*MOE, "--set", "parallel.ep=2", "--set", "parallel.ep_overlap_chunks=0"],
                 "parallel.ep_overlap_chunks", 2, id="zero-overlap-chunks"),
    pytest.param(None, [*MOE, "--set", "parallel.ep_overlap_chunks=2"],
                 "parallel.ep_overlap_chunks = 2 overlaps expert parallelism's all-to-all with "
                 "the experts' compute: set parallel.ep > 1", 2, id="overlap-without-ep"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "model.dropout=0.1"],
                 "parallel.cp = 2 with model.dropout = 0.1: attention dropout is not split", 2,
                 id="cp-with-dropout"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "fault_tolerance.mode='live'"],
                 "parallel.cp = 2 with fault_tolerance.mode = \"live\" is not supported yet",
                 2, id="cp-with-live-replicas"),
    pytest.param(None, ["--set", "parallel.cp=2", "--set", "model.arch='hf'", "--set",
                        "model.hf_config='{tmp}/gpt2'"],
                 "parallel.cp = 2 runs dtrain's GPT and Llama and Hugging Face models of the "
                 "Llama family", 2, id="cp-with-a-gpt2"),
    pytest.param(None, ["--set", "parallel.zero=1", "--set", "memory.offload='optimizer'",
                        "--set", "sync.method='diloco'"],
                 "memory.offload with sync.method = 'diloco' is not supported yet", 2,
                 id="offload-with-diloco"),
    pytest.param(None, ["--set", "parallel.zero=1", "--set", "memory.offload='optimizer'",
                        "--set", "fault_tolerance.mode='live'"],
                 "memory.offload with fault_tolerance.mode = \"live\" is not supported yet", 2,
                 id="offload-with-live-replicas"),
    pytest.param(None, ["--set", "parallel.cp_method='zigzag'"],
                 "parallel.cp_method = 'zigzag' must be one of ring, allgather, alltoall", 2,
                 id="unknown-cp-method"),
    pytest.param(None, ["--set", "train.float8='rowwise'", "--set", "comm.backend='gloo'"],
                 "train.float8 needs a GPU with FP8 tensor cores (compute capability >= 8.9",
                 2, id="float8-on-a-cpu"),
    pytest.param(None, ["--set", "train.float8='rowwise'", "--set", "comm.backend='gloo'",
                        "--set", "parallel.nproc=1"],
                 "train.float8 needs a GPU with FP8 tensor cores (compute capability >= 8.9",
                 2, id="float8-on-a-cpu-one-process"),
    pytest.param(None, ["--set", "train.float8='e4m3'"],
                 "train.float8 = 'e4m3' must be one of none, tensorwise, rowwise", 2,
                 id="unknown-float8-recipe"),
    pytest.param(None, ["--set", "checkpoint.copies=1"],
                 "checkpoint.copies = 1 copies each host's checkpoint files to 1 other "
                 "host(s), and this job has 1 host(s): set it to at most 0", 2,
                 id="replicate-beyond-the-hosts"),
    pytest.param(None, ["--nnodes", "2", "--set", "checkpoint.copies=2"],
                 "this job has 2 host(s): set it to at most 1", 2,
                 id="replicate-beyond-two-hosts"),
    pytest.param("[train\nsteps = 3", [], "not valid TOML", 2, id="malformed-toml"),
    pytest.param("[train]\nsteps = 3\nsteps = 4\n", [], "not valid TOML", 2, id="duplicate-key"),
    pytest.param(b"\xff\xfe[train]\n", [], "cannot read config", 2, id="not-utf8"),
    pytest.param(None, ["{tmp}"], "cannot read config", 2, id="config-is-a-folder"),
    pytest.param(None, ["{tmp}/missing.toml"], "not found", 2, id="config-missing"),
]


@pytest.mark.parametrize("toml, args, message, code", CONFIGS)
def test_bad_config(cli, tmp_path: Path, toml: str | bytes | None, args: list[str],
                    message: str, code: int) -> None:
    if toml is not None:
        config = tmp_path / "c.toml"
        config.write_bytes(toml if isinstance(toml, bytes) else toml.encode())
        args = [str(config), *args]
    before = set(tmp_path.iterdir())
    returned, line = cli("train", *args)
    assert returned == code and message in line
    assert set(tmp_path.iterdir()) == before, "a refused run wrote something"


# ---------------------------------------------------------------------------------- flags
def plan(*flags: str) -> list[str]:
    """`dtrain plan FLAGS`, with a compute rate, link and memory where FLAGS give none, so
    a row the checks miss prints its table at once instead of timing this machine."""
    given = {"--tflops": "1", "--bandwidth": "1", "--memory": "1GB"}
    return ["plan", *flags, *[x for k, v in given.items() if k not in flags for x in (k, v)]]


HELLO = "{tmp}/hello.py"
# (the command line, part of the error line, exit code)
FLAGS = [
    pytest.param([], "the following arguments are required: COMMAND", 2, id="no-command"),
    pytest.param(["trian"], "invalid choice: 'trian'", 2, id="unknown-command"),
    pytest.param(["run", "-n", "0", HELLO], "-n 0: the number of processes must be at least 1",
                 2, id="run-zero-ranks"),
    pytest.param(["run", "-n", "-1", HELLO], "-n -1: the number of processes must be at least "
                 "1", 2, id="run-negative-ranks"),
    pytest.param(["run", "-n", "two", HELLO], "argument -n/--nproc: invalid int value: 'two'",
                 2, id="run-ranks-not-a-number"),
    pytest.param(["run", "--max-restarts", "-1", HELLO], "--max-restarts -1 must be 0 or more",
                 2, id="run-negative-restarts"),
    pytest.param(["run", "--master", "nohost", HELLO], "--master 'nohost' is not HOST:PORT", 2,
                 id="run-master-without-port"),
    pytest.param(["run", "--master", "10.0.0.1:99999", HELLO], "is not HOST:PORT", 2,
                 id="run-master-port-too-big"),
    pytest.param(["run", "--nnodes", "2", HELLO], "needs --master HOST:PORT", 2,
                 id="run-nodes-without-master"),
    pytest.param(["run", "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1", HELLO],
                 "--node-rank 2 must be in [0, 2)", 2, id="run-node-rank-out-of-range"),
    pytest.param(["run", "--nnodes", "3:2", HELLO], "--nnodes 3:2: MIN 3 is more than MAX 2",
                 2, id="run-nnodes-min-above-max"),
    pytest.param(["run", "--nnodes", "0:2", HELLO], "--nnodes 0:2: at least 1 machine is "
                 "needed", 2, id="run-nnodes-min-zero"),
    pytest.param(["run", "--nnodes", "1:x", HELLO], "--nnodes '1:x' is not N or MIN:MAX", 2,
                 id="run-nnodes-not-numbers"),
    pytest.param(["run", "--nnodes", "0", HELLO], "--nnodes 0: at least 1 machine is needed", 2,
                 id="run-zero-nodes"),
    pytest.param(["run", "--join-timeout", "0", HELLO], "--join-timeout 0 must be at least 1", 2,
                 id="run-zero-join-timeout"),
    pytest.param(["run", "--backend", "tcp", HELLO], "invalid choice: 'tcp'", 2,
                 id="run-unknown-backend"),
    pytest.param(["run", "--bogus", HELLO], "unrecognized arguments: --bogus", 2,
                 id="run-unknown-flag"),
    pytest.param(["run"], "the following arguments are required: script", 2,
                 id="run-without-script"),
    pytest.param(["run", "{tmp}/missing.py"], "script '", 2, id="run-missing-script"),
    pytest.param(["run", "--servers", "-1", HELLO], "needs at least one server", 2,
                 id="run-negative-servers"),
    pytest.param(["run", "--servers", "1", "--snapshot-every", "5", HELLO],
                 "--snapshot-every needs --snapshot-dir", 2, id="run-snapshots-without-folder"),
    pytest.param(["run", "--servers", "1", "--snapshot-dir", "{tmp}", "--snapshot-every", "-3",
                  HELLO], "--snapshot-every -3 must be 0 (never) or more", 2,
                 id="run-negative-snapshot-every"),
    pytest.param(["train", "-n", "0"], "parallel.nproc = 0 must be positive", 2,
                 id="train-zero-ranks"),
    pytest.param(["train", "-n", "-2"], "parallel.nproc = -2 must be positive", 2,
                 id="train-negative-ranks"),
    pytest.param(["train", "--nnodes", "3:2"], "--nnodes 3:2: MIN 3 is more than MAX 2", 2,
                 id="train-nnodes-min-above-max"),
    pytest.param(["train", "--nnodes", "0"], "--nnodes 0: at least 1 machine is needed", 2,
                 id="train-zero-nodes"),
    pytest.param(["train", "--node-rank", "3"], "--node-rank 3 must be in [0, 1)", 2,
                 id="train-node-rank-out-of-range"),
    pytest.param(["train", "--max-restarts", "-1"], "--max-restarts -1 must be 0 or more", 2,
                 id="train-negative-restarts"),
    pytest.param(["train", "--master", "nohost"], "--master 'nohost' is not HOST:PORT", 2,
                 id="train-master-without-port"),
    pytest.param(["train", "--join-timeout", "-1"], "--join-timeout -1 must be at least 1", 2,
                 id="train-negative-join-timeout"),
    pytest.param(["train", "--backend", "mpi"], "invalid choice: 'mpi'", 2,
                 id="train-unknown-backend"),
    pytest.param(["train", "--stepz", "3"], "unrecognized arguments: --stepz", 2,
                 id="train-unknown-flag"),
    pytest.param(["train", "--metrics"], "argument --metrics: expected one argument", 2,
                 id="train-flag-without-value"),
    pytest.param(["bench", "nope"], "invalid choice: 'nope'", 2, id="bench-unknown"),
    pytest.param(["bench", "comm", "-n", "0"], "-n 0 must be at least 1", 2,
                 id="bench-comm-zero-ranks"),
    pytest.param(["bench", "comm", "-n", "-3"], "-n -3 must be at least 1", 2,
                 id="bench-comm-negative-ranks"),
    pytest.param(["bench", "comm", "--factor", "1"], "--factor 1 must be at least 2", 2,
                 id="bench-comm-factor-1"),
    pytest.param(["bench", "comm", "--iters", "0"], "--iters 0 must be at least 1", 2,
                 id="bench-comm-zero-iters"),
    pytest.param(["bench", "comm", "--min-bytes", "2"], "less than one float32", 2,
                 id="bench-comm-min-below-float"),
    pytest.param(["bench", "comm", "--min-bytes", "1M", "--max-bytes", "1K"],
                 "--max-bytes 1K is below --min-bytes 1M", 2, id="bench-comm-max-below-min"),
    pytest.param(["bench", "comm", "--max-bytes", "-4"], "'-4' is not a size in bytes", 2,
                 id="bench-comm-negative-size"),
    pytest.param(["bench", "comm", "--ops", "all_reduce,gather"], "unknown 'gather'", 2,
                 id="bench-comm-unknown-op"),
    pytest.param(["bench", "comm", "--json", "{tmp}/missing/out.json"],
                 "its folder does not exist", 2, id="bench-comm-json-folder-missing"),
    pytest.param(["bench", "comm", "--bogus"], "unrecognized arguments: --bogus", 2,
                 id="bench-comm-unknown-flag"),
    pytest.param(["bench", "comm", "--algorithms", "fastest"], "'fastest'", 2,
                 id="bench-comm-unknown-algorithm"),
    pytest.param(["bench", "comm", "--max-bytes", "12X"], "'12X'", 2,
                 id="bench-comm-size-with-unknown-unit"),
    pytest.param(["bench", "comm", "--backend", "tcp"], "'tcp'", 2,
                 id="bench-comm-unknown-backend"),
    pytest.param(plan("-n", "0"), "--devices and --batch must be positive", 2,
                 id="plan-zero-devices"),
    pytest.param(plan("-n", "-4"), "--devices and --batch must be positive", 2,
                 id="plan-negative-devices"),
    pytest.param(plan("--batch", "0"), "--devices and --batch must be positive", 2,
                 id="plan-zero-batch"),
    pytest.param(plan("--memory", "lots"),
                 "--memory 'lots' is not a size in bytes: give a size like 80GB", 2,
                 id="plan-memory-not-a-size"),
    pytest.param(plan("--memory", "1.2.3GB"), "give a size like 80GB", 2,
                 id="plan-memory-two-points"),
    pytest.param(plan("--memory", "0GB"), "--memory '0GB' must be more than 0", 2,
                 id="plan-zero-memory"),
    pytest.param(plan("--tflops", "-1"), "--tflops -1 must be a positive number", 2,
                 id="plan-negative-tflops"),
    pytest.param(plan("--tflops", "fast"), "argument --tflops: invalid float value: 'fast'", 2,
                 id="plan-tflops-not-a-number"),
    pytest.param(plan("--bandwidth", "0"), "--bandwidth 0 must be a positive number", 2,
                 id="plan-zero-bandwidth"),
    pytest.param(plan("--latency", "-1"), "--latency -1 must be 0 or more", 2,
                 id="plan-negative-latency"),
    pytest.param(plan("--schedules", "zigzag"), "schedule='zigzag'", 2,
                 id="plan-unknown-schedule"),
    pytest.param(plan("--schedules", ","), "--schedules is empty", 2, id="plan-no-schedule"),
    pytest.param(plan("--heads", "3"), "model.n_head = 3 does not divide model.n_embd", 2,
                 id="plan-heads-not-dividing-width"),
    pytest.param(plan("--model", "nocolon"), "use package.module:function", 2,
                 id="plan-model-without-factory"),
    pytest.param(plan("--json", "{tmp}/missing/plan.json"), "its folder does not exist", 2,
                 id="plan-json-folder-missing"),
]


@pytest.mark.parametrize("argv, message, code", FLAGS)
def test_bad_flags(cli, argv: list[str], message: str, code: int) -> None:
    returned, line = cli(*argv)
    assert returned == code and message in line


# ---------------------------------------------------------------------------------- checkpoints
def _damage(path: str, data: bytes | Callable[[bytes], bytes] | None) -> Callable[[Path], None]:
    """Replace the file `path` (under the checkpoints folder) with `data`, or with
    `data(old bytes)`; None deletes it."""
    def damage(folder: Path) -> None:
        file = folder / path
        if data is None:
            file.unlink()
        else:
            file.write_bytes(data(file.read_bytes()) if callable(data) else data)
    return damage


def _format(version: str) -> Callable[[bytes], bytes]:
    return lambda old: json.dumps({**json.loads(old), "format": version}).encode()


STEP = "step-00000003"
INDEX = f"{STEP}/index.json"
SHARD = f"{STEP}/rank-00000.safetensors"
RESUME = ["train", "--resume"]


# (what to do to a good checkpoint in {ckpt}, the command line, part of the error line, exit code)
CHECKPOINTS = [
    pytest.param(_damage(SHARD, lambda old: old[: len(old) // 2]), [*RESUME, "{ckpt}"],
                 "rank-00000.safetensors is corrupted (checksum mismatch)", 2,
                 id="truncated-safetensors"),
    pytest.param(_damage(SHARD, lambda old: old[: len(old) // 2]), [*RESUME, "{ckpt}/" + STEP],
                 "rank-00000.safetensors is corrupted (checksum mismatch)", 2,
                 id="truncated-safetensors-step-folder"),
    pytest.param(_damage(SHARD, None), [*RESUME, "{ckpt}"], "rank-00000.safetensors is missing",
                 2, id="missing-safetensors"),
    pytest.param(None, [*RESUME, "{ckpt}", "--set", "model.n_embd=64"],
                 "holds another model (model.n_embd = 128 there, 64 here)", 2,
                 id="another-model"),
    pytest.param(_damage(INDEX, _format("dtrain.universal/99")), [*RESUME, "{ckpt}"],
                 "this dtrain reads dtrain.universal/1", 2, id="format-version"),
    pytest.param(_damage(INDEX, _format("dtrain.universal/99")), [*RESUME, "{ckpt}/" + STEP],
                 "this dtrain reads dtrain.universal/1", 2, id="format-version-step-folder"),
    pytest.param(_damage(INDEX, b"{not json"), [*RESUME, "{ckpt}"], "index.json is unreadable",
                 2, id="index-not-json"),
    pytest.param(_damage(INDEX, b"{not json"), [*RESUME, "{ckpt}/" + STEP], "index.json", 2,
                 id="index-not-json-step-folder"),
    pytest.param(_damage("index.json", b"{not json"), [*RESUME, "{ckpt}"], "index.json", 2,
                 id="folder-index-not-json"),
    pytest.param(_damage("index.json", b"[]"), [*RESUME, "{ckpt}"], "index.json", 2,
                 id="folder-index-a-list"),
    pytest.param(_damage(INDEX, lambda old: json.dumps({
        k: v for k, v in json.loads(old).items() if k != "files"}).encode()),
        [*RESUME, "{ckpt}"], "index.json is incomplete (no 'files')", 2,
        id="index-without-files"),
    pytest.param(None, [*RESUME, "{tmp}"], "no checkpoint in", 2, id="folder-without-checkpoint"),
    pytest.param(None, [*RESUME, "{tmp}/missing/checkpoints"], "no checkpoint in", 2,
                 id="missing-folder"),
    pytest.param(None, [*RESUME, "{tmp}/hello.py"], "no checkpoint in", 2, id="a-file"),
    pytest.param(_damage(SHARD, lambda old: old[:100]), ["export", "{ckpt}", "{tmp}/m.pt"],
                 "rank-00000.safetensors is corrupted", 1, id="export-truncated"),
    pytest.param(None, ["export", "{tmp}", "{tmp}/m.pt"], "no checkpoint in", 1,
                 id="export-folder-without-checkpoint"),
    pytest.param(None, ["export", "{ckpt}", "{tmp}/m.bin"], "must end in .safetensors or .pt", 1,
                 id="export-unknown-suffix"),
    pytest.param(None, ["generate", "{tmp}/missing/checkpoints"], "no checkpoint in", 2,
                 id="generate-missing-checkpoint"),
    pytest.param(_damage(SHARD, lambda old: old[:100]), ["generate", "{ckpt}"],
                 "rank-00000.safetensors is corrupted", 2, id="generate-truncated"),
    pytest.param(None, ["generate", "{ckpt}", "-n", "3", "--set", "parallel.tp=2"],
                 "does not divide the world size 3", 2, id="generate-layout-not-dividing"),
    pytest.param(None, ["generate", "{ckpt}", "-n", "2", "--set", "parallel.tp=3"],
                 "parallel.tp = 3 does not divide", 2, id="generate-tp-not-dividing-heads"),
    pytest.param(None, ["generate", "{ckpt}", "--tokens", "-1"], "--tokens -1 must be 0 or more",
                 2, id="generate-negative-tokens"),
    pytest.param(None, ["generate", "{ckpt}", "--temperature", "0"], "--temperature 0.0 must be",
                 2, id="generate-zero-temperature"),
    pytest.param(None, ["generate", "{ckpt}"], "does not record its config and model", 2,
                 id="generate-without-model"),
]


@pytest.mark.parametrize("damage, argv, message, code", CHECKPOINTS)
def test_bad_checkpoint(cli, tmp_path: Path, damage: Callable[[Path], None] | None,
                        argv: list[str], message: str, code: int) -> None:
    """A checkpoint of the default model (one tensor of it is enough to open one), damaged."""
    folder = tmp_path / "run" / "checkpoints"
    meta = {"config": load_config(None).to_dict()}
    universal.save(folder, 3, universal.pieces_of("model/wte.weight", torch.ones(4, 2)), {},
                   meta, keep_last=2, group=None)
    if damage is not None:
        damage(folder)
    argv = [a.replace("{ckpt}", str(folder)) for a in argv]
    returned, line = cli(*argv)
    assert returned == code and message in line


# ---------------------------------------------------------------------------------- data
def _write(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _folder(files: dict[str, bytes]) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.mkdir()
        for name, data in files.items():
            (path / name).write_bytes(data)
    return make


BINARY = bytes(range(256)) * 10
# id: (how to make data.path, `dtrain train` flags, part of the error line, marks)
DATA = {
    "missing": (lambda path: None, ["-n", "1"], "does not exist", ()),
    "empty-file": (_write(b""), ["-n", "1"], "holds no text", ()),
    "empty-folder": (_folder({}), ["-n", "1"], "holds no text", ()),
    "binary-file": (_write(BINARY), ["-n", "1"], "looks binary (NUL bytes): give a text file", ()),
    "folder-of-binaries": (_folder({"a.bin": BINARY, "b.bin": b"\0"}), ["-n", "1"],
                           "holds no text", ()),
    "too-small": (_write(b"print('hi')\n"), ["-n", "1"], "too few for model.block_size", ()),
    "missing-on-two-ranks": (lambda path: None, [], "does not exist", ()),
}


@pytest.fixture(scope="module")
def data_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every data row's `dtrain train`, run all at once (they mostly wait on imports)."""
    folder = tmp_path_factory.mktemp("data")

    def run(name: str) -> subprocess.CompletedProcess:
        make, flags, _, _ = DATA[name]
        make(folder / name)
        return dtrain("train", *flags, "--set", f"data.path='{folder / name}'", "--set",
                      f"train.out_dir='{folder / 'runs' / name}'", timeout=100)

    with ThreadPoolExecutor(len(DATA)) as pool:
        return dict(zip(DATA, pool.map(run, DATA), strict=True))


@pytest.mark.parametrize("name", [pytest.param(name, id=name, marks=case[3])
                                  for name, case in DATA.items()])
def test_bad_data(data_runs: dict[str, subprocess.CompletedProcess], name: str) -> None:
    result = data_runs[name]
    assert result.returncode == 2 and DATA[name][2] in one_error_line(result)


# ---------------------------------------------------------------------------------- ps
SECRET, NUMEL, WORKERS = b"job-secret", 4, 2
BOMB_MARKER = Path(tempfile.gettempdir()) / f"dtrain-test-pickle-bomb-{os.getpid()}"


class _Bomb:
    """Unpickling this runs a shell command (that leaves BOMB_MARKER)."""

    def __reduce__(self):
        return os.system, (f"touch {BOMB_MARKER}",)


BOMB = pickle.dumps(_Bomb())


def _signed(header: bytes, payload: bytes = b"") -> list[bytes]:
    return [header, hmac.new(SECRET, header + payload, hashlib.sha256).digest(), payload]


def _message(op: str, worker: int = 0, tensor: torch.Tensor | None = None,
             meta: dict | None = None, secret: bytes = SECRET) -> list:
    return ps.pack(secret, ps.Message(op, worker, 0, tensor, meta=meta))


def _seed(meta: dict | None = None, tensor: torch.Tensor | None = None, worker: int = 0) -> list:
    """Worker 0's init: the shard and the job's settings."""
    tensor = torch.zeros(NUMEL) if tensor is None else tensor
    return _message("init", worker, tensor,
                    {"optimizer": "sgd", "consistency": "async"} if meta is None else meta)


def _push(tensor: torch.Tensor, **kwargs) -> list:
    return _message("push", tensor=tensor, **kwargs)


# (sent to a server already seeded?, the frames, part of the reason it replies)
MESSAGES = [
    pytest.param(False, _push(torch.zeros(NUMEL)), "before worker 0 seeded", id="push-unseeded"),
    pytest.param(False, _seed({"optimizer": "sgd", "eval": "rm -rf"}), "unknown settings",
                 id="init-unknown-setting"),
    pytest.param(False, _seed({"optimizer": "adam", "betas": [2, 0.9]}), "betas=(2.0, 0.9)",
                 id="init-betas-out-of-range"),
    pytest.param(False, _seed({"momentum": -1}), "must not be negative",
                 id="init-negative-momentum"),
    pytest.param(False, _seed({"lr": "fast"}), "malformed settings", id="init-lr-a-string"),
    pytest.param(False, _seed(tensor=torch.zeros(NUMEL).double()), "init needs a float32 tensor",
                 id="init-float64"),
    pytest.param(False, _seed(worker=1), "only worker 0 seeds", id="init-from-worker-1"),
    pytest.param(True, _push(torch.zeros(NUMEL), secret=b"a stranger"), "bad HMAC",
                 id="bad-hmac"),
    pytest.param(True, _signed(b'{"op":"pull","worker":0,"clock":0}')[:2] + [b"extra"],
                 "bad HMAC", id="payload-not-signed"),
    pytest.param(True, [b"\0" * 1024] * 3, "bad HMAC", id="unsigned-frames"),
    pytest.param(True, [BOMB, b"\0" * 32, BOMB], "bad HMAC", id="pickle-bomb-unsigned"),
    pytest.param(True, _signed(BOMB), "malformed header", id="pickle-bomb-header"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0}', BOMB),
                 "payload without a dtype", id="pickle-bomb-payload"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":"float32","numel":4}',
                               BOMB), f"payload of {len(BOMB)} bytes does not hold 4 float32",
                 id="pickle-bomb-as-tensor"),
    pytest.param(True, [b"just one"], "expected 3 frames, got 1", id="one-frame"),
    pytest.param(True, _signed(b"{not json"), "malformed header", id="header-not-json"),
    pytest.param(True, _signed(b"[1, 2]"), "malformed header", id="header-a-list"),
    pytest.param(True, _signed(b'\xff\xfe{"op"'), "malformed header", id="header-not-utf8"),
    pytest.param(True, _signed(b'{"op":"pull","worker":0}'), "malformed header",
                 id="header-without-clock"),
    pytest.param(True, _signed(b'{"op":"pull","worker":Infinity,"clock":0}'), "malformed header",
                 id="worker-infinite"),
    pytest.param(True, _signed(b'{"op":"pull","worker":0.5,"clock":0}'), "malformed header",
                 id="worker-a-fraction"),
    pytest.param(True, _signed(b'{"op":"delete","worker":0,"clock":0}'), "unknown op 'delete'",
                 id="unknown-op"),
    pytest.param(True, _message("reply"), "a worker may not send 'reply'", id="op-reply"),
    pytest.param(True, _message("pull", worker=7), "unknown worker 7", id="unknown-worker"),
    pytest.param(True, _push(torch.zeros(NUMEL + 1)), f"this shard holds {NUMEL}",
                 id="push-wrong-shape"),
    pytest.param(True, _push(torch.zeros(0)), f"push of 0 values, but this shard holds {NUMEL}",
                 id="push-empty"),
    pytest.param(True, _push(torch.zeros(NUMEL).double()), "push needs a float32 tensor",
                 id="push-float64"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":"int64","numel":1}',
                               b"\0" * 8), "unsupported dtype 'int64'", id="dtype-int64"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":[1],"numel":1}',
                               b"\0" * 4), "unsupported dtype [1]", id="dtype-a-list"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":"float32",'
                               b'"numel":"4"}', b"\0" * 16), "numel '4' is not an integer",
                 id="numel-a-string"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":"float32",'
                               b'"numel":1e400}'), "numel inf is not an integer",
                 id="numel-infinite"),
    pytest.param(True, _signed(b'{"op":"push","worker":0,"clock":0,"dtype":"float32",'
                               b'"numel":1000000000000000}', b"\0" * 16),
                 "payload of 16 bytes does not hold 1000000000000000 float32",
                 id="oversized-numel"),
    pytest.param(True, _push(torch.zeros(NUMEL), meta={"lr": -1}), "lr -1 is not a finite",
                 id="push-negative-lr"),
    pytest.param(True, _signed(b'{"op":"pull","worker":0,"clock":0,"meta":[1]}'),
                 "meta is not an object", id="meta-a-list"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seeded, frames, reason", MESSAGES)
def test_bad_message(seeded: bool, frames: list, reason: str) -> None:
    """The server answers the bad message with the reason and keeps serving: worker 0 then
    seeds it (again), pushes and pulls, and both workers stop it."""
    server = ps.Server(WORKERS, SECRET, NUMEL)
    serving = threading.Thread(target=server.serve, kwargs={"idle_timeout": 20}, daemon=True)
    serving.start()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.address)

    def send(frames: list) -> ps.Message:
        socket.send_multipart(frames)
        assert socket.poll(5000), "the server did not answer"
        return ps.unpack(SECRET, socket.recv_multipart())

    try:
        if seeded:
            assert send(_seed()).error == ""
        assert reason in send(frames).error
        assert [reason in r for r in server.rejected] == [True]
        assert send(_seed()).error == ""
        assert send(_push(torch.ones(NUMEL), meta={"lr": 0.5})).error == ""
        pulled = send(_message("pull"))
        # async: each push moves the shard 1/WORKERS of lr x gradient
        assert pulled.error == "" and torch.equal(pulled.tensor, torch.full((NUMEL,), -0.25))
        for worker in range(WORKERS):
            assert send(_message("stop", worker)).error == ""
        serving.join(5)
        assert not serving.is_alive() and len(server.rejected) == 1
        assert not BOMB_MARKER.exists(), "something unpickled a message"
    finally:
        socket.close()
        context.term()


def _rss() -> int:
    """This process's resident memory, bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) << 10


@pytest.mark.timeout(60)
def test_an_oversized_frame_is_refused_before_it_is_buffered() -> None:
    """A stranger without the secret sends one 1 GiB frame: the server's sockets cap frames
    at a shard's bytes (ZMQ_MAXMSGSIZE), so ZeroMQ drops the connection on reading the
    frame's length instead of buffering it for the HMAC check; memory grows by under
    10 MiB and the server goes on serving."""
    server = ps.Server(WORKERS, SECRET, NUMEL)
    serving = threading.Thread(target=server.serve, kwargs={"idle_timeout": 20}, daemon=True)
    serving.start()
    huge = mmap.mmap(-1, 1 << 30)  # untouched zero pages: the sender holds no real memory
    # Contexts of their own: the stranger's I/O thread is busy with its GiB.
    with zmq.Context() as theirs, zmq.Context() as ours:
        stranger, worker = theirs.socket(zmq.DEALER), ours.socket(zmq.DEALER)
        for socket in (stranger, worker):
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(server.address)
        try:
            worker.send_multipart(_seed())
            assert worker.poll(30_000)  # a process's first optimizer imports much of torch
            worker.recv_multipart()
            before = _rss()
            stranger.send_multipart([b"{}", b"\0" * 32, memoryview(huge)], copy=False)
            time.sleep(1.0)  # time enough to buffer a GiB through loopback
            worker.send_multipart(_message("pull"))
            assert worker.poll(10_000), "the server stopped answering"
            assert ps.unpack(SECRET, worker.recv_multipart()).error == ""
            assert _rss() - before < 10 << 20
            assert not server.rejected  # the frame never reached the server's loop
            for w in range(WORKERS):
                worker.send_multipart(_message("stop", w))
                assert worker.poll(10_000)
                worker.recv_multipart()
            serving.join(5)
            assert not serving.is_alive()
        finally:
            stranger.close()
            worker.close()
            huge.close()
