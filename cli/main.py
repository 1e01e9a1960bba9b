"""The `diloco` command line. It parses options and calls the library; nothing else lives here.

Each command is a function in a module of its kind (roles.py: the worker roles; local.py: a job
on this machine; tools.py: status, finish, export, eval, generate, tokenizers, certificates); this
module only assembles them. Every command that talks to a coordinator takes the identity flags
(cli.common.with_security).
"""

from __future__ import annotations

import typer

from cli import local, roles, simulate, tools
from cli.common import with_security

app = typer.Typer(
    help="Resilient, low-communication distributed training (Decoupled DiLoCo).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for name, command in (
    ("coordinator", roles.coordinator),
    ("data", roles.data),
    ("compute", roles.compute),
    ("evaluator", roles.evaluator),
    ("status", tools.status),
    ("finish", tools.finish),
    ("export", tools.export),
    ("eval", tools.eval_),
    ("generate", tools.generate),
):
    app.command(name)(with_security(command))
app.command()(local.run)
app.command()(simulate.simulate)
app.command()(simulate.tune)
app.command(hidden=True)(roles.standby)

tokenizer_app = typer.Typer(help="Tokenizers for `data.tokenizer`.", no_args_is_help=True)
tokenizer_app.command("train")(tools.tokenizer_train)
app.add_typer(tokenizer_app, name="tokenizer")

certs_app = typer.Typer(help="Certificates for mutual TLS between the roles.", no_args_is_help=True)
certs_app.command("init")(tools.certs_init)
certs_app.command("issue")(tools.certs_issue)
certs_app.command("revoke")(tools.certs_revoke)
app.add_typer(certs_app, name="certs")
