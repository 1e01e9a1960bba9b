"""A flag out of range is refused as it is parsed, naming the flag, with exit code 2 and no
traceback; never carried into a worker that connects, a model that samples, or a recommendation
(a new user's walk through the CLI found each of these accepted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from cli.common import ConfigOpt
from diloco.config import ConfigError, RunConfig
from diloco.errors import DilocoError
from diloco.evaluate import sample_text
from diloco.simulate.config import LinkConfig
from diloco.simulate.tune import recommend
from tests.support import cli

ADDRESS = "127.0.0.1:1"  # never reached: each refusal comes first


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles' entry points replaced by recorders: a test sees whether a worker would have run
    (and no logging or signal handlers are set up in the test process)."""
    calls: list[str] = []

    def recorder(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> int:
            calls.append(name)
            return 0

        return record

    monkeypatch.setattr("cli.roles.setup_logging", lambda *_: None)
    monkeypatch.setattr("cli.roles.stop_on_signals", lambda: None)
    monkeypatch.setattr("diloco.compute.start.run_learner", recorder("learner"))
    monkeypatch.setattr("diloco.evaluator.run_evaluator", recorder("evaluator"))

    def no_model(*args: Any, **kwargs: Any) -> Any:
        calls.append("load_model")
        raise DilocoError("a model was loaded")

    monkeypatch.setattr("diloco.results.load_model", no_model)
    return calls


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("compute", "--threads", "-4"), "--threads"),
        (("compute", "--slow-factor", "-2"), "--slow-factor"),
        (("compute", "--slow-factor", "0.5"), "--slow-factor"),
        (("compute", "--nproc", "0"), "--nproc"),
        (("evaluator", "--every", "-5"), "--every"),
        (("evaluator", "--threads", "0"), "--threads"),
    ],
)
def test_a_role_flag_has_its_config_keys_range(started: list[str], args: tuple[str, ...], flag: str) -> None:
    """train.threads >= 0, eval.threads >= 1, eval.every_s >= 0, and a group of >= 1 ranks no
    slower than itself: the flags standing for them are refused before a worker starts."""
    code, output = cli(args[0], "--coordinator", ADDRESS, *args[1:])
    assert code == 2, output
    assert flag in output and "Traceback" not in output
    assert started == []


def test_a_role_flag_in_range_still_starts_the_worker(started: list[str]) -> None:
    assert cli("compute", "--coordinator", ADDRESS, "--threads", "0", "--slow-factor", "1")[0] == 0
    assert cli("evaluator", "--coordinator", ADDRESS, "--every", "0", "--threads", "1")[0] == 0
    assert started == ["learner", "evaluator"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("generate", "run", "--tokens", "20", "--temperature", "-5"), "--temperature"),
        (("generate", "run", "--tokens", "-3"), "--tokens"),
        (("eval", "run", "--max-batches", "-1"), "--max-batches"),
        (("status", "--watch", "-1"), "--watch"),
    ],
)
def test_a_negative_count_or_temperature_is_refused(
    started: list[str], args: tuple[str, ...], flag: str
) -> None:
    code, output = cli(*args)
    assert code == 2, output
    assert flag in output and "Traceback" not in output
    assert started == []  # refused before the model is loaded


class Uniform(nn.Module):
    """A token model whose logits favour token 1: greedy or sampled, the text is known."""

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(idx.size(0), idx.size(1), 4)
        out[..., 1] = 10.0
        return out


class Letters:
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return [2] * len(text)

    def decode(self, ids: list[int]) -> str:
        return "".join("ab"[i - 1] if i in (1, 2) else "?" for i in ids)


def test_sampling_refuses_a_negative_temperature() -> None:
    """Dividing the logits by -5 makes the least likely token the likeliest: junk, not a sample."""
    with pytest.raises(DilocoError, match="--temperature must be >= 0"):
        sample_text(Uniform(), Letters(), "x", 3, "cpu", seed=0, temperature=-5.0)
    with pytest.raises(DilocoError, match="--tokens must be >= 0"):
        sample_text(Uniform(), Letters(), "x", -1, "cpu", seed=0)
    assert sample_text(Uniform(), Letters(), "x", 3, "cpu", seed=0, temperature=0.0) == "xaaa"  # greedy


def test_tune_refuses_a_step_model_or_link_that_cannot_be() -> None:
    code, output = cli("tune", "--step-s", "-1", "--params", "-5", "--learners", "0", "--json")
    assert code == 2, output
    assert output.count("\n") == 1 and output.startswith("error: ")
    assert "--step-s" in output and "--params" in output and "--learners" in output
    code, output = cli("tune", "--step-s", "0", "--params", "1e6")
    assert code == 2 and "--step-s must be > 0" in output, output
    with pytest.raises(DilocoError, match="--bandwidth"):
        recommend(step_s=0.2, link=LinkConfig(params=1e6, bandwidth_gbps=0.0))


def test_simulate_refuses_json_with_a_plot(tmp_path: Path) -> None:
    code, output = cli(
        "simulate", "--json", "--plot", str(tmp_path / "x.png"), "--chips", "512", "--hours", "1"
    )
    assert code == 2, output
    assert output.count("\n") == 1 and "--plot" in output and "--json" in output
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("key", "hint"), [("train.quorum", "sync.quorum"), ("quorum", "sync.quorum")])
def test_a_key_in_the_wrong_section_names_the_right_one(started: list[str], key: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {hint}\\?"):
        RunConfig().with_overrides({key: "1"})
    code, output = cli("coordinator", "--workdir", "unused", "--set", f"{key}=1")
    assert code == 2 and f"did you mean {hint}?" in output, output


def test_a_key_no_section_has_gets_no_hint() -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig().with_overrides({"train.bogus": "1"})
    assert str(refused.value) == "unknown config key 'train.bogus'"


def test_the_config_help_names_every_section() -> None:
    help_text = ConfigOpt.__metadata__[0].help
    for section in ("model", "data", "train", "sync", "coordinator", "eval"):
        assert f"\\[{section}]" in help_text
