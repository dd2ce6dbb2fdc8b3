"""Where rank 0's metrics go: the JSON-lines file, TensorBoard and Weights & Biases, all
fed by one call.

    sinks = open_sinks(config, metrics_path, enabled=world.is_main, resumed=False, say=print)
    sinks.record(step, {"loss": 3.2, "lr": 1e-3, "tokens_per_s": 41_000.0})
    sinks.close()

The JSON-lines file takes each record whole. TensorBoard (`[logging] tensorboard = true`,
event files under out_dir/tensorboard) and W&B (`[logging] wandb = "offline"` or
"online", the run folder under out_dir/wandb) take its numbers as scalars, each under a
tag of its group ("train/loss", "speed/mfu", "memory/peak_memory_gib"), a list one scalar
per element ("moe/moe_imbalance/0" for the first MoE layer). Both are optional
dependencies, `pip install 'dtrain[tensorboard]'` and `'dtrain[wandb]'`: a run that asks
for one that is missing stops before it starts, with one line. Each opens at its first
record, so a rank that never records (another live replica's) leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dtrain.config import Config, LoggingConfig
from dtrain.errors import ConfigError
from dtrain.train.metrics import MetricsLog

if TYPE_CHECKING:  # both optional: imported when a run logs to them
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

Value = float | int | str | list[float] | dict[str, int]
"""What a record holds: numbers, a list per MoE layer, or a few words."""

GROUPS = {"loss": "train", "lr": "train", "grad_norm": "train", "eval_loss": "eval",
          "tokens_per_s": "speed", "tflops": "speed", "mfu": "speed", "step_time_s": "speed",
          "slowest_rank": "speed", "slowest_busy_s": "speed", "slowest_vs_median": "speed",
          "peak_memory_gib": "memory", "moe_imbalance": "moe", "moe_dropped": "moe"}
"""The tag group of each metric dtrain records (others: "train")."""

NOT_SCALARS = ("step", "time")


class Sink(Protocol):
    """One place metrics go."""

    def record(self, step: int, values: Mapping[str, Value]) -> None: ...

    def close(self) -> None: ...


def scalars(values: Mapping[str, Value]) -> dict[str, float]:
    """The numbers of a record by tag: `group/name`, a list's elements `group/name/i`;
    the step, the wall time and text are left out."""
    out: dict[str, float] = {}
    for name, value in values.items():
        if name in NOT_SCALARS:
            continue
        tag = f"{GROUPS.get(name, 'train')}/{name}"
        if isinstance(value, bool | int | float):
            out[tag] = float(value)
        elif isinstance(value, list):
            out.update({f"{tag}/{i}": float(v) for i, v in enumerate(value)})
        elif isinstance(value, dict):
            out.update({f"{tag}/{k}": float(v) for k, v in value.items()})
    return out


class JsonLines:
    """The JSON-lines file: one object per record, `{"step": step, **values}`."""

    def __init__(self, log: MetricsLog) -> None:
        self.log = log

    def record(self, step: int, values: Mapping[str, Value]) -> None:
        self.log.write({"step": step, **values})

    def has(self, step: int) -> bool:
        return self.log.has(step)

    def close(self) -> None:
        self.log.close()


class TensorBoard:
    """TensorBoard event files in `folder`, written by torch.utils.tensorboard."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writer: SummaryWriter | None = None

    def record(self, step: int, values: Mapping[str, Value]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder))
        for tag, value in scalars(values).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    """A Weights & Biases run under `folder` (mode "offline" or "online"), its config the
    job's."""

    def __init__(self, folder: Path, mode: str, project: str, config: dict[str, object],
                 say: Callable[[str], None]) -> None:
        self.folder, self.mode, self.project, self.config = folder, mode, project, config
        self.say = say
        self.run: Run | None = None

    def record(self, step: int, values: Mapping[str, Value]) -> None:
        if self.run is None:
            import wandb

            self.folder.mkdir(parents=True, exist_ok=True)
            # console="off": wandb leaves stdout alone (the progress lines are dtrain's)
            # "offline" or "online" (no sink is made for "off")
            self.run = wandb.init(project=self.project, dir=str(self.folder),
                                  mode=self.mode,  # type: ignore[arg-type]
                                  config=self.config,
                                  settings=wandb.Settings(silent=True, console="off"))
            where = "synced to wandb.ai" if self.mode == "online" else \
                f"offline; upload it with `wandb sync {Path(self.run.dir).parent}`"
            self.say(f"wandb: run {self.run.name or self.run.id} ({where})")
        self.run.log(scalars(values), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class Sinks:
    """Every sink of a run, fed together; the JSON-lines file first."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def has(self, step: int) -> bool:
        """Whether the JSON-lines file holds a record of `step` (another process's too:
        a live replica's that wrote the steps before)."""
        first = self.sinks[0]
        return isinstance(first, JsonLines) and first.has(step)

    def record(self, step: int, values: Mapping[str, Value]) -> None:
        """Send `values` of `step` to every sink."""
        for sink in self.sinks:
            sink.record(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_dependencies(cfg: LoggingConfig) -> None:
    """Raises ConfigError, with the pip command, when a sink asked for is not installed."""
    wanted = [("tensorboard", "tensorboard", cfg.tensorboard),
              ("wandb", "wandb", cfg.wandb != "off")]
    for extra, module, on in wanted:
        if on and not _installed(module):
            key = "tensorboard = true" if extra == "tensorboard" else f'wandb = "{cfg.wandb}"'
            raise ConfigError(f"[logging] {key} needs the {module} package: "
                              f"pip install 'dtrain[{extra}]'")


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there: an import that is known to fail
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def has_wandb_key() -> bool:
    """Whether W&B can log in: WANDB_API_KEY is set, or ~/.netrc (or $NETRC) has a login
    for its host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host.rstrip("/")) \
            is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: LoggingConfig, say: Callable[[str], None]) -> str:
    """The mode W&B runs in: "online" without a key falls back to "offline" (one line)."""
    if cfg.wandb == "online" and not has_wandb_key():
        say("wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline instead; "
            "upload the run later with `wandb sync`")
        return "offline"
    return cfg.wandb


def open_sinks(config: Config, metrics_path: str, enabled: bool, resumed: bool,
               say: Callable[[str], None]) -> Sinks:
    """The sinks `config` asks for (the JSON-lines file at `metrics_path` or
    `[logging] metrics`, TensorBoard, W&B); none but an inert file where not `enabled`
    (every rank but 0). `resumed`: the JSON-lines file goes on; `say` prints a line.

    Raises:
        ConfigError: TensorBoard or W&B asked for and not installed.
    """
    cfg = config.logging
    check_dependencies(cfg)
    sinks: list[Sink] = [JsonLines(MetricsLog(metrics_path or cfg.metrics, enabled, resumed))]
    if not enabled:
        return Sinks(sinks)
    out_dir = Path(config.train.out_dir)
    if cfg.tensorboard:
        sinks.append(TensorBoard(out_dir / "tensorboard"))
    if cfg.wandb != "off":
        sinks.append(WandB(out_dir / "wandb", wandb_mode(cfg, say), cfg.wandb_project,
                           config.to_dict(), say))
    return Sinks(sinks)
