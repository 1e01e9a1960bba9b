"""The user's code, named in the config ("package.module:function") and imported where it runs:
a model factory on learners, a preprocess on data workers. Nothing of it travels over the wire."""

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
