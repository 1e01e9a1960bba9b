"""The README is the configuration reference: it must name every key the config accepts. The
command line's help must show what it says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from diloco.config import RunConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def config_keys() -> list[str]:
    keys = []
    for f in dataclasses.fields(RunConfig):
        value = getattr(RunConfig(), f.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            keys.append(f.name)
    return keys


def test_readme_documents_every_config_key() -> None:
    text = README.read_text()
    missing = [k for k in config_keys() if f"`{k}`" not in text]
    assert not missing, f"README's configuration reference lacks: {missing}"


def test_readme_opens_with_the_two_commands() -> None:
    head = README.read_text().splitlines()[:6]
    assert "```bash" in head
    commands = [line for line in head if line.startswith("bash ")]
    assert [c.split()[1] for c in commands] == ["scripts/run.sh", "scripts/test.sh"]


@pytest.mark.parametrize("command", ["coordinator", "run"])
def test_config_help_shows_the_section_names(command: str) -> None:
    # Rich would read "[model]" as markup and print nothing in its place.
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for section in ("[model]", "[data]", "[train]", "[sync]", "[coordinator]"):
        assert section in result.output, result.output
