"""A preset against the keys the user sets: a key set in the config file or with `--set`
wins over the preset's value even when it sets ModelConfig's default (`mtp_depth = 0`
drops deepseek-tiny's MTP module); a key not set takes the preset's; a ModelConfig built
in Python counts only values off their defaults, unless it names its keys in `explicit`
(dtrain.models.config.with_preset)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dtrain.config import config_from_dict, load_config
from dtrain.errors import ConfigError
from dtrain.models import ModelConfig, build, presets, resolve
from dtrain.models.config import with_preset

DEEPSEEK = ["model.arch='llama'", "model.preset='deepseek-tiny'"]
DUALPIPEV = ["parallel.pp=2", "parallel.schedule='dualpipev'", "parallel.virtual_stages=2",
             "parallel.microbatches=4"]


def from_file(tmp_path: Path, keys: str, overrides: tuple[str, ...] = ()) -> ModelConfig:
    """The resolved `[model]` of a config file holding deepseek-tiny and `keys`."""
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\narch = "llama"\npreset = "deepseek-tiny"\n{keys}\n')
    return resolve(load_config(str(path), overrides).model, 256)


@pytest.mark.timeout(60)
def test_mtp_depth_zero_in_the_file_builds_no_mtp_module(tmp_path: Path) -> None:
    cfg = from_file(tmp_path, "mtp_depth = 0")
    assert cfg.mtp_depth == 0
    model = build(cfg)
    assert model.mtp is None
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())


@pytest.mark.timeout(60)
def test_mtp_depth_zero_with_set_builds_no_mtp_module() -> None:
    cfg = resolve(load_config(None, [*DEEPSEEK, "model.mtp_depth=0"]).model, 256)
    assert cfg.mtp_depth == 0 and build(cfg).mtp is None


@pytest.mark.timeout(60)
def test_set_overrides_the_file_and_still_counts_as_set(tmp_path: Path) -> None:
    """The file asks for two MTP modules, `--set` for none: none, not the preset's one."""
    assert from_file(tmp_path, "mtp_depth = 2", ("model.mtp_depth=0",)).mtp_depth == 0


@pytest.mark.timeout(60)
def test_other_defaults_set_explicitly_win_over_the_preset(tmp_path: Path) -> None:
    cfg = from_file(tmp_path, "n_shared_experts = 0\nmoe_layers = \"all\"\nq_lora_rank = 0")
    assert (cfg.n_shared_experts, cfg.moe_layers, cfg.q_lora_rank) == (0, "all", 0)
    model = build(cfg)
    assert all(block.mlp.shared is None for block in model.blocks)
    tied = resolve(load_config(None, ["model.arch='llama'", "model.preset='llama-3.2-1b'",
                                      "model.tie_embeddings=false"]).model, 256)
    assert not tied.tie_embeddings
    qwen = resolve(load_config(None, ["model.arch='llama'", "model.preset='qwen3-30b-a3b'",
                                      "model.qk_norm=false"]).model, 256)
    assert not qwen.qk_norm and qwen.head_dim == 128  # the rest still the preset's


@pytest.mark.timeout(60)
def test_keys_not_set_take_the_presets_values(tmp_path: Path) -> None:
    cfg = from_file(tmp_path, "n_layer = 2")
    assert (cfg.n_layer, cfg.mtp_depth, cfg.n_shared_experts, cfg.attention,
            cfg.n_embd) == (2, 1, 1, "mla", 128)
    assert build(cfg).mtp is not None
    tied = resolve(load_config(None, ["model.arch='llama'",
                                      "model.preset='llama-3.2-1b'"]).model, 256)
    assert tied.tie_embeddings


@pytest.mark.timeout(60)
def test_values_off_their_defaults_still_win(tmp_path: Path) -> None:
    cfg = from_file(tmp_path, "mtp_depth = 2\nn_embd = 64")
    assert (cfg.mtp_depth, cfg.n_embd) == (2, 64)
    assert resolve(load_config(None, [*DEEPSEEK, "model.n_shared_experts=2"]).model,
                   256).n_shared_experts == 2


@pytest.mark.timeout(60)
def test_the_checks_see_the_model_the_user_set() -> None:
    """deepseek-tiny's MTP module is refused under DualPipeV; without it, the layout is
    accepted (the config's own checks apply the preset as the model is built)."""
    with pytest.raises(ConfigError, match="model.mtp_depth = 1 with parallel.schedule"):
        load_config(None, [*DEEPSEEK, *DUALPIPEV])
    load_config(None, [*DEEPSEEK, *DUALPIPEV, "model.mtp_depth=0"])


@pytest.mark.timeout(60)
def test_the_keys_set_reach_the_ranks_through_the_configs_dict() -> None:
    """Ranks, a resume and `dtrain generate` rebuild the config from `to_dict()`: the
    keys set travel with it; a dict without them (an older dtrain's) keeps the old rule."""
    config = load_config(None, [*DEEPSEEK, "model.mtp_depth=0"])
    values = config.to_dict()
    again = config_from_dict(values)
    assert again == config and again.model.explicit == {"arch", "preset", "mtp_depth"}
    assert resolve(again.model, 256).mtp_depth == 0
    older = {k: v for k, v in values.items() if k in dataclasses.asdict(config)}
    assert resolve(config_from_dict(older).model, 256).mtp_depth == 1
    with pytest.raises(ConfigError, match="model_explicit"):
        config_from_dict({**values, "model_explicit": "mtp_depth"})


@pytest.mark.timeout(60)
def test_a_config_without_model_keys_records_none() -> None:
    assert load_config(None).model.explicit == frozenset()
    assert "model_explicit" not in load_config(None).to_dict()


@pytest.mark.timeout(60)
def test_a_model_config_built_in_python() -> None:
    """In Python a keyword passed at its default cannot be told from one left out: it takes
    the preset's value, as before; naming it in `explicit`, or replacing the resolved
    config, keeps it."""
    plain = ModelConfig(arch="llama", preset="deepseek-tiny", mtp_depth=0)
    assert resolve(plain, 256).mtp_depth == 1
    assert resolve(ModelConfig(arch="llama", preset="deepseek-tiny", mtp_depth=2),
                   256).mtp_depth == 2
    named = ModelConfig(arch="llama", preset="deepseek-tiny", mtp_depth=0)
    named.explicit = frozenset({"mtp_depth"})
    filled = with_preset(named, presets())
    assert filled.mtp_depth == 0 and filled.n_layer == 3 and filled.explicit == named.explicit
    assert with_preset(filled, presets()) == filled
    assert build(resolve(named, 256)).mtp is None
    replaced = dataclasses.replace(resolve(plain, 256), mtp_depth=0)
    assert build(replaced).mtp is None
