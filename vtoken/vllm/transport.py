"""What travels between the vToken scheduler (engine core) and the vToken worker, and how.

Scheduler → worker: a ``StepPlan`` in a declared field of ``VTokenSchedulerOutput`` (a dataclass subclass
of vLLM's ``SchedulerOutput``; the scheduler switches the output object's class). Worker → scheduler: a
``StepResult`` in a declared field of ``VTokenModelRunnerOutput``. Both ride the paths vLLM already uses
for ``SchedulerOutput`` / ``ModelRunnerOutput``:

* multiprocess executor (CPU always; GPU with TP/PP > 1): pickled through the shared-memory
  ``MessageQueue``; plain dataclasses and numpy arrays pickle cheaply, and a declared dataclass field also
  survives ``dataclasses.replace`` (which the V1 runner applies to the scheduler output for ngram-GPU
  speculative decoding), unlike an ad-hoc attribute;
* uni-process executor (GPU, TP = 1): the same objects, by reference — a plan is never mutated after it
  is attached.

The changed block-ID contract (vLLM's rows are append-only): ``StepPlan.truncate[req_id] = n`` tells the
worker to cut the request's block row to its first ``n`` blocks *before* this step's ``new_block_ids``
are appended, and ``StepPlan.replace[req_id] = {index: block_id}`` to put ``block_id`` at ``index`` of the
row (copy on write: a prefix-cached or shared block the step must not write leaves the row for a
replacement; vtoken/core/cow.py). The scheduler has already returned the cut and replaced blocks to vLLM's
BlockPool, and the moves in ``StepPlan`` (physical slots: sources through the row before the
replacements, destinations through the row after them; they read from those blocks) run before
anything else in the step can write them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from vtoken.core.step_stats import SlotScores


@dataclass
class RequestStep:
    """Worker instructions for one scheduled request (physical = logical - ``offset``)."""

    offset: int  # tokens seen minus live tokens after this step's placement: seq_len_phys = seq_len - offset
    slots: np.ndarray | None = None  # row-relative slots of the new tokens when not simply appended (reuse)
    scores: bool = False  # collect the attention statistics over the live keys
    key_norm: bool = False  # collect the new keys' L2 norms
    norm_back: int = 0  # with key_norm: also the norms of the ``norm_back`` keys just before the new ones
    # (row slots seq_len - n - norm_back ..): prefix-cache hits of a fresh table, computed by no step of it
    window: int = 0  # > 0: the step's first ``window`` queries end the prompt (it computes the prompt's last
    # token): collect the observation-window statistic, Σ over the last ≤ OBSERVATION_WINDOW of them
    redundancy: bool = False  # with scores: also each live key's mean cosine similarity to the others (R-KV)
    score_layers: int | None = None  # with scores: how many attention layers score (None: every layer;
    # the worker picks which: vtoken.core.config.score_layer_indices)
    first: int = 0  # with scores: the first row slot scored (< seq_len; below it every token stays forever:
    # vtoken.core.scored_range); the softmax still covers every live key


@dataclass
class StepPlan:
    """Everything the worker must do for vToken this step (immutable once attached)."""

    src: np.ndarray  # int64 [k] physical source slots of this step's moves (all requests)
    dst: np.ndarray  # int64 [k] physical destination slots
    truncate: dict[str, int] = field(default_factory=dict)  # req_id -> blocks kept (before appends)
    replace: dict[str, dict[int, int]] = field(default_factory=dict)  # req_id -> {row index: new block id}
    requests: dict[str, RequestStep] = field(default_factory=dict)  # scheduled requests with a token table
    step: int = -1  # the scheduler's step number: the worker echoes it, the scheduler matches results by it

    @property
    def num_moves(self) -> int:
        return int(self.src.shape[0])

    def __bool__(self) -> bool:
        return bool(self.num_moves or self.truncate or self.replace or self.requests)


@dataclass
class StepResult:
    """What the worker hands back: per-request score payloads and the time its moves took."""

    scores: dict[str, SlotScores] = field(default_factory=dict)  # request id -> what the worker measured
    move_seconds: float = 0.0
    num_moves: int = 0
    step: int = -1  # the StepPlan.step it answers (async scheduling: results arrive while a later step runs)


@dataclass
class VTokenSchedulerOutput(SchedulerOutput):
    vtoken: StepPlan | None = None


@dataclass
class VTokenModelRunnerOutput(ModelRunnerOutput):
    vtoken: StepResult | None = None


def _carry(out: Any, base: type, carrier: type, value: object) -> None:
    """Put ``value`` in ``out``'s ``vtoken`` field, switching an output of exactly vLLM's ``base`` class to
    ``carrier`` (its subclass declaring the field) first. Mutates ``out``."""
    if type(out) is base:
        out.__class__ = carrier
    out.vtoken = value


def attach_plan(out: SchedulerOutput, plan: StepPlan) -> SchedulerOutput:
    """Attach ``plan`` to the scheduler output (switches its class; mutates ``out``)."""
    _carry(out, SchedulerOutput, VTokenSchedulerOutput, plan)
    return out


def plan_of(out: SchedulerOutput) -> StepPlan | None:
    return getattr(out, "vtoken", None)


def attach_result(out: ModelRunnerOutput, result: StepResult) -> ModelRunnerOutput:
    """Attach ``result`` (switches the class; never touches vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if out is EMPTY_MODEL_RUNNER_OUTPUT:
        out = ModelRunnerOutput(**{f: getattr(out, f) for f in out.__dataclass_fields__})
    _carry(out, ModelRunnerOutput, VTokenModelRunnerOutput, result)
    return out


def result_of(out: ModelRunnerOutput) -> StepResult | None:
    return getattr(out, "vtoken", None)
