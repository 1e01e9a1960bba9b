"""The `diloco` command line. It parses options and calls the library; nothing else lives here.

Each command is a function in a module of its kind (roles.py: the worker roles; local.py: a job
on this machine; tools.py: status, export, tokenizers); this module only assembles them.
"""

from __future__ import annotations

import typer

from cli import local, roles, tools

app = typer.Typer(
    help="Resilient, low-communication distributed training (Decoupled DiLoCo).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for command in (
    roles.coordinator,
    roles.data,
    roles.compute,
    roles.evaluator,
    local.run,
    tools.status,
    tools.export,
):
    app.command()(command)
app.command("eval")(tools.eval_)
app.command()(tools.generate)
app.command(hidden=True)(roles.standby)

tokenizer_app = typer.Typer(help="Tokenizers for `data.tokenizer`.", no_args_is_help=True)
tokenizer_app.command("train")(tools.tokenizer_train)
app.add_typer(tokenizer_app, name="tokenizer")
