"""The training config: defaults, overrides, and one clear error per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import MOVED, Config, config_from_dict, dims_of, load_config
from dtrain.errors import ConfigError
from tests.support.cli import dtrain, one_error_line


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_and_file_and_overrides(tmp_path: Path) -> None:
    assert load_config(None) == Config()
    path = write(tmp_path, "[train]\nsteps = 7\n[optimizer]\nlr = 1\n")
    overrides = ["model.n_layer=2", "data.path=some/dir", "optimizer.betas=[0.8, 0.9]"]
    config = load_config(path, overrides)
    assert config.train.steps == 7 and config.optimizer.lr == 1.0
    assert config.model.n_layer == 2 and config.data.path == "some/dir"
    assert config.optimizer.betas == [0.8, 0.9]
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize("text, overrides, message", [
    ("[train]\nstepz = 3\n", [], "unknown key 'train.stepz' (did you mean 'train.steps'?)"),
    ("[trian]\nsteps = 3\n", [], "unknown section [trian] (did you mean 'train'?)"),
    ("[train]\nsteps = 'ten'\n", [], "train.steps = 'ten' must be int, not str"),
    ("[train]\nsteps = -1\n", [], "train.steps = -1 must be positive"),
    ("[train]\nsteps = true\n", [], "must be int, not bool"),
    ("[model]\nn_head = 3\n", [], "model.n_head = 3 does not divide model.n_embd = 128"),
    ("[optimizer]\nname = 'lamb'\n", [], "must be one of adamw, adam, sgd"),
    ("steps = 3\n", [], "key 'steps' is outside any [section]: put it under [train]"),
    ("[train\n", [], "not valid TOML"),
    ("", ["train.steps"], "is not section.key=value"),
    ("", ["train.steps=-5"], "must be positive"),
    ("", ["optimizer.betas=[0.9]"], "two numbers"),
])
def test_mistakes_are_named(tmp_path: Path, text: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.toml")


def test_batch_must_split_across_ranks_and_micro_batches() -> None:
    config = load_config(None, ["train.batch_size=12", "train.grad_accum=2"])
    assert dims_of(config, 3).per_rank_batch(12, 2) == 2
    with pytest.raises(ConfigError, match="make it a multiple of 8"):
        dims_of(config, 4)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_key_names_its_new_place(tmp_path: Path, old: str, new: str) -> None:
    """Every key that moved (out of [parallel], or renamed) is refused in a file and in
    --set, in one line that names where it went; the new key takes the same value."""
    section, name = new.split(".")
    value = getattr(getattr(Config(), section), name)
    shown = {bool: str(value).lower(), str: f"'{value}'"}.get(type(value), str(value))
    home, key = old.split(".")
    for path, overrides in ((write(tmp_path, f"[{home}]\n{key} = {shown}\n"), []),
                            (None, [f"{old}={shown}"])):
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides)
        assert str(info.value).endswith(f"{old} moved to {new}")
        assert "\n" not in str(info.value)
    assert load_config(None, [f"{new}={shown}"]) == Config()


@pytest.mark.parametrize("overrides, message", [
    (["comm.compression='int8'", "fault_tolerance.mode='live'"],
     "comm.compression = 'int8' with fault_tolerance.mode = \"live\""),
    (["sync.method='diloco'", "fault_tolerance.mode='live'"],
     "use parallel.exchange = \"collective\" and fault_tolerance.mode = \"restart\""),
    (["sync.method='diloco'", "comm.compression='powersgd'"],
     "every sync.every steps only: leave comm.compression = \"none\""),
    (["parallel.zero=1", "comm.grad_dtype='bf16'"], "comm.grad_dtype is for DataParallel"),
    (["comm.compression='int8'", "comm.grad_dtype='bf16'"], "replaces comm.grad_dtype"),
    (["parallel.mixed_precision='bf16'"], "DataParallel takes comm.grad_dtype"),
    (["fault_tolerance.step_timeout=0"], "fault_tolerance.step_timeout = 0.0 must be positive"),
    (["ps.servers=0"], "ps.servers = 0 must be positive"),
])
def test_checks_across_sections_name_the_new_keys(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.timeout(120)
def test_a_moved_key_stops_dtrain_train_before_anything_is_written(tmp_path: Path) -> None:
    result = dtrain("train", "--set", "parallel.sync_every=5", "--set",
                    f"train.out_dir='{tmp_path / 'run'}'")
    assert result.returncode == 2
    assert one_error_line(result) == ("dtrain: error: --set: parallel.sync_every moved to "
                                      "sync.every"), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_config_an_older_dtrain_saved_is_read_with_its_moved_keys_in_place() -> None:
    """A checkpoint keeps the config of the run that saved it; one saved before a rename
    still reads (`dtrain generate`, a resume), each moved key set at its new place."""
    old = Config().to_dict()
    old["parallel"]["mode"] = old["parallel"].pop("exchange")
    old["memory"]["activation_checkpointing"] = "full"
    del old["memory"]["recompute"]
    old["sync"]["replicas"] = old["sync"].pop("groups")
    config = config_from_dict(old)
    assert config.memory.recompute == "full" and config.parallel.exchange == "collective"
    with pytest.raises(ConfigError, match="memory.activation_checkpointing moved to "
                                          "memory.recompute"):
        load_config(None, ["memory.activation_checkpointing='full'"])
