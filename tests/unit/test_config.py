"""A RunConfig round-trips through JSON and TOML and takes overrides; one that cannot run is refused
at once, with the key named."""

from __future__ import annotations

import json

import pytest

from diloco.config import ConfigError, RunConfig, parse_assignments


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("sync", "outer_warmup_rounds", -1),
        ("sync", "max_staleness", -1),
        ("sync", "mix_alpha", 1.0),
        ("sync", "stale_decay", 0.0),
        ("sync", "stale_decay", 1.5),
        ("sync", "fragments", 0),
    ],
)
def test_a_bad_sync_value_is_refused_naming_its_key(section: str, key: str, value: object) -> None:
    config = RunConfig()
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        config.validate()


def test_the_defaults_and_an_outer_warmup_are_valid() -> None:
    config = RunConfig()
    config.validate()
    for rounds in (0, 1, 50):  # none, the least, longer than the default's
        config.sync.outer_warmup_rounds = rounds
        config.validate()


# -- config -------------------------------------------------------------------------------------------


def custom_config() -> RunConfig:
    return RunConfig().with_overrides(
        {
            "name": "exp-1",
            "model.kwargs.n_layer": 2,
            "model.kwargs.dropout": 0.1,
            "data.dataset": '/data/with "quotes"\\and é',
            "train.lr": 3e-4,
            "train.warmup_steps": 5,
            "sync.merge": "rda",
            "sync.nesterov": False,
            "sync.quorum": 2,
            "coordinator.lease_ttl_s": 12.5,
        }
    )


def test_config_json_round_trip():
    cfg = custom_config()
    assert cfg != RunConfig()
    assert RunConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["sync"]["merge"] == "rda"


def test_config_toml_round_trip(tmp_path):
    cfg = custom_config()
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig().merged_with_toml(path) == cfg
    assert RunConfig.from_toml(path) == cfg


def test_default_config_toml_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RunConfig().to_toml())
    assert RunConfig.from_toml(path) == RunConfig()


def test_config_toml_round_trip_non_bmp_string(tmp_path):
    cfg = RunConfig().with_overrides({"data.dataset": "/data/\U0001f600/corpus"})
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml(), encoding="utf-8")
    assert RunConfig.from_toml(path) == cfg


def test_merged_with_toml_keeps_unset_keys(tmp_path):
    path = tmp_path / "part.toml"
    path.write_text('[train]\ninner_steps = 7\n[sync]\nmerge = "token"\n')
    base = RunConfig().with_overrides({"train.batch_size": 3})
    merged = base.merged_with_toml(path)
    assert merged.train.inner_steps == 7
    assert merged.sync.merge == "token"
    assert merged.train.batch_size == 3
    assert base.train.inner_steps == RunConfig().train.inner_steps  # the base is not changed


def test_unknown_top_level_key_refused(tmp_path):
    with pytest.raises(ConfigError, match="bogus"):
        RunConfig.from_dict({"bogus": 1})
    path = tmp_path / "bad.toml"
    path.write_text("bogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        RunConfig.from_toml(path)
    with pytest.raises(ConfigError, match="bogus"):
        RunConfig().merged_with_toml(path)


def test_unknown_key_in_section_refused(tmp_path):
    with pytest.raises(ConfigError, match="lr_typo") as info:
        RunConfig.from_dict({"train": {"lr_typo": 0.1}})
    assert "train" in str(info.value)
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlr_typo = 0.1\n")
    with pytest.raises(ConfigError, match="lr_typo"):
        RunConfig().merged_with_toml(path)
    with pytest.raises(ConfigError, match="nosuch"):
        RunConfig.from_dict({"nosuch": {"x": 1}})


@pytest.mark.parametrize(
    "data",
    [
        {"train": {"batch_size": "many"}},
        {"train": {"batch_size": 1.5}},
        {"train": {"lr": True}},
        {"train": {"lr": "fast"}},
        {"sync": {"nesterov": "yes"}},
        {"sync": {"merge": 3}},
        {"name": 5},
        {"train": 5},
    ],
)
def test_wrong_type_refused(data):
    with pytest.raises(ConfigError):
        RunConfig.from_dict(data)


def test_bad_toml_and_missing_file_are_config_errors(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="TOML"):
        RunConfig.from_toml(path)
    with pytest.raises(ConfigError, match="not found"):
        RunConfig.from_toml(tmp_path / "missing.toml")


def test_a_negative_publish_interval_is_refused():
    assert RunConfig().with_overrides({"coordinator.min_publish_interval_s": 0}).validate()
    with pytest.raises(ConfigError, match="min_publish_interval_s"):
        RunConfig().with_overrides({"coordinator.min_publish_interval_s": -1}).validate()
    # 1 would leave no fallback for a reader that read the ledger just before a commit.
    for keep in (0, 2, 5):
        assert RunConfig().with_overrides({"coordinator.keep_versions": keep}).validate()
    for keep in (1, -1):
        with pytest.raises(ConfigError, match="keep_versions"):
            RunConfig().with_overrides({"coordinator.keep_versions": keep}).validate()


def test_with_overrides_coerces_strings():
    cfg = RunConfig().with_overrides(
        {
            "train.inner_steps": "100",
            "train.lr": "0.01",
            "sync.nesterov": "false",
            "sync.quorum": "-1",
            "name": "x",
            "train.grad_clip": 0,
        }
    )
    assert cfg.train.inner_steps == 100 and isinstance(cfg.train.inner_steps, int)
    assert cfg.train.lr == 0.01
    assert cfg.sync.nesterov is False
    assert cfg.sync.quorum == -1
    assert cfg.name == "x"
    assert cfg.train.grad_clip == 0.0 and isinstance(cfg.train.grad_clip, float)


def test_with_overrides_ignores_none_and_leaves_original():
    base = RunConfig()
    cfg = base.with_overrides({"train.inner_steps": None, "train.batch_size": 2})
    assert cfg.train.inner_steps == base.train.inner_steps
    assert cfg.train.batch_size == 2
    assert base.train.batch_size == RunConfig().train.batch_size


@pytest.mark.parametrize("key", ["train.nope", "nosection.lr", "train.lr.deeper", "nope"])
def test_with_overrides_refuses_unknown_keys(key):
    with pytest.raises(ConfigError, match="unknown"):
        RunConfig().with_overrides({key: "1"})


def test_with_overrides_refuses_bad_value():
    with pytest.raises(ConfigError, match="train.inner_steps"):
        RunConfig().with_overrides({"train.inner_steps": "ten"})


def test_validate():
    cfg = RunConfig()
    assert cfg.validate() is cfg
    with pytest.raises(ConfigError, match="model.factory"):
        RunConfig().with_overrides({"model.factory": "diloco.model.gpt.gpt"}).validate()
    with pytest.raises(ConfigError, match="merge"):
        RunConfig().with_overrides({"sync.merge": "median"}).validate()
    with pytest.raises(ConfigError):
        RunConfig().with_overrides({"data.eval_fraction": 1.0}).validate()
    with pytest.raises(ConfigError):
        RunConfig().with_overrides({"sync.fragments": 0}).validate()
    with pytest.raises(ConfigError):
        RunConfig().with_overrides({"coordinator.stream_chunk_bytes": 5 << 20}).validate()


def test_parse_assignments():
    assert parse_assignments(["train.lr=0.01", " sync.merge = rda ", "data.dataset=a=b"]) == {
        "train.lr": "0.01",
        "sync.merge": "rda",
        "data.dataset": "a=b",
    }
    assert RunConfig().with_overrides(parse_assignments(["train.lr=0.01"])).train.lr == 0.01
    for bad in ("nonsense", "=5", " =x"):
        with pytest.raises(ConfigError, match="section.key=value"):
            parse_assignments([bad])


def test_the_config_accepts_exactly_the_codecs_the_wire_knows():
    # config_checks keeps its own names so that reading a config imports no torch; a codec added to
    # the wire must be one a config may name, and the other way round.
    from diloco.config_checks import CODECS
    from diloco.wire.codecs import CODECS as WIRE_CODECS

    assert CODECS == WIRE_CODECS
