"""The user's code, named in the config ("package.module:function") and imported where it runs:
a model factory on learners, a preprocess on data workers. Nothing of it travels over the wire,
and the name does not decide alone: a worker imports a name its coordinator sends only when it is
diloco's own or the worker's operator allowed it (--model, --preprocess, DILOCO_ALLOW_CODE)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from diloco.errors import DilocoError


def a_or_an(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def searched_here() -> None:
    """The working directory on the import path, in every process: `python -m` puts it there
    (the roles `diloco run` starts), the `diloco` console script does not, and the same spec must
    import in both (the run's own process builds the model for its final evaluation)."""
    here = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        sys.path.append(here)


def resolve(spec: str, key: str) -> Callable[..., Any]:
    """The function `spec` ("package.module:function") names; `key` is its config key, for errors."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DilocoError(f'{key} {spec!r}: expected "package.module:function"')
    searched_here()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DilocoError(f"{key} {spec!r}: cannot import {module_name} here ({e})") from e
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise DilocoError(f"{key} {spec!r}: {module_name} has no {attr}")
    if not callable(fn):
        raise DilocoError(f"{key} {spec!r}: {attr} is {a_or_an(type(fn).__name__)}, not a function")
    return fn


# Code a worker imports because the coordinator's config names it: diloco's own, and what the
# worker's operator allowed on its own machine. The coordinator chooses among these, never beyond.
BUILT_IN = frozenset({"diloco.model.gpt:gpt", "diloco.model.hf:causal_lm", "diloco.data.preprocess:columns"})
ALLOW_ENV = "DILOCO_ALLOW_CODE"
_allowed_here: set[str] = set()


def allow(*specs: str | None) -> None:
    """Allow this process to import `specs` when the coordinator names them (a worker's --model,
    --preprocess: its operator's word, not the coordinator's)."""
    _allowed_here.update(s.strip() for s in specs if s and s.strip())


def named_here() -> frozenset[str]:
    """What this machine's operator named: allow()'s and DILOCO_ALLOW_CODE's (comma-separated;
    "package.module:*" allows every function of that module)."""
    from_env = {s.strip() for s in os.environ.get(ALLOW_ENV, "").split(",") if s.strip()}
    return frozenset(_allowed_here | from_env)


def allowed_code() -> frozenset[str]:
    return BUILT_IN | named_here()


def unallowed(spec: str, key: str, flag: str) -> str | None:
    """Why this worker must not import `spec`, which the coordinator's `key` names, or None."""
    allowed = allowed_code()
    if not spec or spec in allowed or f"{spec.partition(':')[0]}:*" in allowed:  # "module:*": all of it
        return None
    return (
        f"{key} {spec!r} from the coordinator is not allowed here: a worker imports only diloco's "
        f"own code and what its operator names; if you trust it, pass {flag} {spec} "
        f"(or set {ALLOW_ENV}={spec})"
    )


def refuse_unallowed(spec: str, key: str, flag: str) -> None:
    """DilocoError (one line, at join) when the coordinator names code this worker did not allow."""
    if problem := unallowed(spec, key, flag):
        raise DilocoError(problem)


def refuse_untrusted_model(model: Any) -> None:
    """A learner's or evaluator's check of the coordinator's model.factory and model.kwargs: the
    factory must be allowed, and only a factory its operator named may be asked to run a model
    repository's own code (Hugging Face's trust_remote_code)."""
    refuse_unallowed(model.factory, "model.factory", "--model")
    if model.kwargs.get("trust_remote_code") and model.factory not in named_here():
        raise DilocoError(
            f"model.kwargs trust_remote_code from the coordinator runs a model repository's code: "
            f"pass --model {model.factory} on this machine if you trust it"
        )
