"""diloco eval, generate and export on a run whose weights are a user's own model (diloco.connect
with examples/own-loop): they build the model the coordinator names (--model), and weights of
another model than that are refused in one line that says what to pass, never a KeyError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.client import CoordinatorClient
from diloco.config import RunConfig
from diloco.coordinator.server import start_coordinator
from diloco.data.worker import DataWorker
from diloco.model.weights import save_weights
from diloco.v1 import coordinator_pb2 as pb
from tests.support import REPO, cli

OWN_LOOP = REPO / "examples/own-loop"


@contextlib.contextmanager
def own_loop_run(corpus: Path, workdir: Path, factory: str | None) -> Iterator[str]:
    """A live coordinator (`--model factory`, or none: the built-in GPT) whose shards are made and
    whose parameters a learner of the own-loop example gave: its Llama's. Yields the address."""
    from own_model import llama

    overrides = {"data.dataset": str(corpus), "data.chunk_bytes": 65536, "sync.fragments": 1}
    cfg = RunConfig().with_overrides({**overrides, "model.factory": factory})
    running = start_coordinator(cfg, str(workdir))
    address = f"127.0.0.1:{running.port}"
    try:
        assert DataWorker(address).run() == 0
        learner = CoordinatorClient(address, pb.ROLE_COMPUTE)
        learner.join()
        init = {n: p.detach().clone() for n, p in llama().named_parameters()}
        assert learner.init_parameters(init).accepted
        learner.close()
        save_weights(str(workdir / "model.safetensors"), init)  # as `diloco run` leaves its model
        yield address
    finally:
        running.stop()


@pytest.mark.timeout(150)
def test_weights_of_another_model_are_refused_in_one_line_naming_the_flag(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(OWN_LOOP))
    workdir = tmp_path / "own"
    with own_loop_run(tiny_corpus, workdir, None) as address:
        for args in (
            ["eval", str(workdir)],
            ["eval", str(workdir / "model.safetensors")],
            ["eval", "--coordinator", address],
            ["generate", str(workdir), "--tokens", "2"],
            ["export", str(workdir), "--format", "hf", "--out", str(tmp_path / "hf")],
            ["export", "--coordinator", address, "--out", str(tmp_path / "st")],
        ):
            code, out = cli(*args)
            assert code == 2, (args, out)
            lines = out.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in out, (args, out)
            assert "diloco.model.gpt:gpt" in lines[0] and "--model" in lines[0], lines[0]
            assert "missing ['transformer." in lines[0], lines[0]
            assert "unexpected ['lm_head.weight'" in lines[0], lines[0]
        # Told which model the weights are, each of them works.
        for run in (workdir, workdir / "model.safetensors"):
            code, out = cli("eval", str(run), "--model", "own_model:llama", "--max-batches", "1")
            assert code == 0 and "loss " in out, out
        code, out = cli("eval", "--coordinator", address, "--model", "own_model:llama", "--max-batches", "1")
        assert code == 0 and "loss " in out, out
        code, out = cli("generate", str(workdir), "--model", "own_model:llama", "--tokens", "3")
        assert code == 0 and out.startswith("def "), out
    code, out = cli(
        "export", str(workdir), "--format", "hf", "--out", str(tmp_path / "hf"), "--model", "own_model:llama"
    )
    assert code == 0 and (tmp_path / "hf" / "config.json").exists(), out


@pytest.mark.timeout(150)
def test_a_coordinator_that_names_the_own_loop_model_needs_nothing_more(
    tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's instructions: `diloco coordinator --model own_model:llama`; then the tools
    read the run as it is."""
    monkeypatch.syspath_prepend(str(OWN_LOOP))
    workdir = tmp_path / "own"
    with own_loop_run(tiny_corpus, workdir, "own_model:llama"):
        pass
    code, out = cli("eval", str(workdir), "--max-batches", "1")
    assert code == 0 and "unigram baseline" in out, out
    code, out = cli("export", str(workdir), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0, out
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.config.vocab_size == 257
    assert exported.config.architectures == ["LlamaForCausalLM"]  # what every loader knows
    # End-of-text is the run's (the byte tokenizer's 256), not Llama's defaults (1 and 2, which are
    # bytes): generate() stopped at them.
    assert exported.config.eos_token_id == exported.generation_config.eos_token_id == 256
    assert exported.config.bos_token_id == 256


def test_eval_on_data_the_preprocess_was_not_written_for_is_one_line(tmp_path: Path) -> None:
    from diloco.errors import DilocoError
    from diloco.results import dataset_columns

    (tmp_path / "notes.txt").write_text("no labels here\n" * 50)
    cfg = RunConfig().with_overrides({"data.preprocess": "tests.toy_models:needs_label"})
    with pytest.raises(DilocoError, match=r"tests.toy_models:needs_label.*KeyError"):
        dataset_columns(cfg, str(tmp_path / "notes.txt"))


def test_eval_before_the_held_out_shards_are_made_says_so() -> None:
    """A run whose held-out chunks are not shards yet is not a run without a held-out split."""
    import torch.nn as nn

    from diloco.errors import DilocoError
    from diloco.results import LoadedModel, held_out_columns

    waiting = LoadedModel(RunConfig(), nn.Linear(1, 1), "x", [], [1], eval_chunks=2)
    with pytest.raises(DilocoError, match=r"held-out split \(2 chunks\) has no shards yet"):
        held_out_columns(waiting)
    with pytest.raises(DilocoError, match="the run has no held-out split: give --dataset"):
        held_out_columns(LoadedModel(RunConfig(), nn.Linear(1, 1), "x", [], [1]))
