"""What the first learner's initial parameters must be before they become the run's model.

The init decides every learner's model and which tensors are running statistics (merged as a
plain mean, outside the outer step and its outlier check), so it is checked at its header, before
the one initialization slot is taken or a byte of it is kept: its tensors (names, float dtypes,
sizes, how many), the `averaged` marks (exactly the tensors named as running statistics), that the
run's fragments can split it, and, where this process can build it, that it is model.factory's
model: names, shapes, dtypes and marks alike (`model_problem`).

The reference model is built once, in a thread of its own started with the service (only while
the run has no parameters), on the meta device: no memory and no init arithmetic whatever the
model's size. Measured: 15 ms for the built-in GPT after the first meta build of a process, which
imports torch's compiler (1.4 s of CPU, +75 MB): off the request path. Where the factory cannot be
built here (a user's package not installed on the coordinator's machine), or the coordinator is
left at the built-in GPT while the learners bring a model of their own (`diloco.connect` without
`--model`: no tensor name in common), the init is taken as before, and that is logged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from diloco.config import ModelConfig
from diloco.coordinator.limits import id_problem
from diloco.errors import DilocoError
from diloco.fragments import assign_fragments
from diloco.model.contract import (
    averaged_marks_problem,
    layout_difference,
    parameter_layout,
    running_stats,
    synced_tensors,
)
from diloco.model.factory import factory_kwargs
from diloco.plugins import resolve
from diloco.v1 import coordinator_pb2 as pb
from diloco.wire.tensors import DTYPES, nbytes_of

# Tensors an init may hold: far above any model (a 405B Llama has ~1,100), and low enough that
# splitting them into fragments stays under a second or two (assign_fragments is quadratic).
MAX_INIT_TENSORS = 16384
MAX_TENSOR_NAME_BYTES = 1024
FLOAT_DTYPES = frozenset(name for name, dtype in DTYPES.items() if dtype.is_floating_point)
BUILT_IN_FACTORY = ModelConfig().factory


@dataclass(frozen=True)
class ModelLayout:
    """What the coordinator knows of the run's model: each tensor's shape and dtype, by name, and
    which are running statistics."""

    factory: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    averaged: frozenset[str]


def header_problem(
    specs: Sequence[pb.TensorSpec], max_bytes: int, fragments: int
) -> tuple[list[list[str]], str]:
    """The fragments the init's tensors split into, and why its header is refused ("" when it is
    not), from the header alone."""
    if not specs:
        return [], "init parameters hold no tensor"
    if len(specs) > MAX_INIT_TENSORS:
        return [], f"{len(specs)} tensors (at most {MAX_INIT_TENSORS})"
    for spec in specs:
        if problem := id_problem(spec.name, "a tensor name", MAX_TENSOR_NAME_BYTES) or (
            "" if spec.name else "a tensor has no name"
        ):
            return [], problem
        if spec.dtype not in FLOAT_DTYPES:
            return [], f"{spec.name!r} is {spec.dtype!r}: init parameters must be floats"
        if any(d < 0 for d in spec.shape):
            return [], f"negative dimension in {spec.name!r}"
    if len({s.name for s in specs}) != len(specs):
        return [], "tensor names repeat"
    total = sum(nbytes_of(s) for s in specs)
    if total > max_bytes:
        return [], f"{total} bytes (at most coordinator.max_push_bytes = {max_bytes})"
    if problem := averaged_marks_problem({s.name: s.averaged for s in specs}):
        return [], problem
    try:
        # By element counts, as every learner splits its model (and a restart, base._fragment_names).
        plan = assign_fragments([(s.name, math.prod(s.shape)) for s in specs], fragments)
    except ValueError as e:  # fewer tensors than fragments
        return [], f"{e} (sync.fragments = {fragments})"
    return plan, ""


def model_problem(specs: Sequence[pb.TensorSpec], model: ModelLayout | None, why_not: str) -> tuple[str, str]:
    """(why the init is not the run's model: refused, why it could not be checked: taken as it
    is). `model`: the run's, or None where it could not be built (`why_not`)."""
    if model is None:
        return "", why_not
    got = {s.name: (tuple(s.shape), s.dtype) for s in specs}
    if model.factory == BUILT_IN_FACTORY and not set(got) & set(model.tensors):
        return "", (
            f"it shares no tensor with the built-in {model.factory}: the learners bring a model of "
            "their own (diloco.connect); start the coordinator with --model naming it to check it"
        )
    difference = layout_difference(model.tensors, got)
    marks = sorted(
        s.name for s in specs if s.averaged != (s.name in model.averaged) and s.name in model.tensors
    )
    if marks and not difference:
        difference = f"running statistics marked otherwise: {marks[:3]}"
    if difference:
        return f"not the model of model.factory {model.factory}: {difference}", ""
    return "", ""


def build_layout(config: ModelConfig) -> ModelLayout:
    """model.factory's model on the meta device (factory.build_model's call, without its seeded
    fork of the global RNG: this runs beside the service's threads, and in-process learners')."""
    fn = resolve(config.factory, "model.factory")
    with torch.device("meta"):
        built = fn(**factory_kwargs(fn, config))
    if not isinstance(built, nn.Module):
        raise DilocoError(
            f"model.factory {config.factory} returned a {type(built).__name__}, not an nn.Module"
        )
    tensors = synced_tensors(built)
    return ModelLayout(config.factory, parameter_layout(tensors), frozenset(running_stats(built)))


class RunModel:
    """The run's model layout, built once in a thread of its own (`start`), asked by the init."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.layout: ModelLayout | None = None
        self.problem = ""
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="run-model", daemon=True)
                self._thread.start()

    def join(self, timeout_s: float) -> None:
        """At the service's stop: a build still under way (importing torch's compiler) killed
        with its interpreter aborts the process ("terminate called without an active exception")."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def get(self, wait_s: float) -> tuple[ModelLayout | None, str]:
        """(the layout, "") once built; else (None, why not), waiting up to `wait_s` for the build."""
        self.start()
        if not self._done.wait(wait_s):
            return None, f"model.factory {self.config.factory} was still being built after {wait_s:.0f} s"
        return self.layout, self.problem

    def _build(self) -> None:
        try:
            self.layout = build_layout(self.config)
        except Exception as e:  # a user's factory may raise anything: then nothing is checked
            text = " ".join(str(e).split())[:300]
            self.problem = (
                f"model.factory {self.config.factory} cannot be built here ({type(e).__name__}: {text})"
            )
        finally:
            self._done.set()
