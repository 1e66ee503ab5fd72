"""Teacher forcing as decoding: a vLLM logits processor that makes a request generate given tokens.

A request whose ``SamplingParams.extra_args`` holds ``"teacher": [t0, t1, …]`` samples ``t_i`` at its
``i``-th output step (every other logit is set to ``-inf``; past the list it samples freely). Each output
token is still one decode step of the engine, so vToken's policy scores and evicts after every token exactly
as it does while generating; the log-probabilities vLLM returns are the raw model's (``logprobs_mode``
``raw_logprobs``, computed before logits processors run), so the returned log-probability of ``t_i`` is the
model's. Used by ``vtoken bench longgen``; no other request is touched (a request without the key gets
``None``: vLLM skips it).

vLLM internal (0.32, listed in ``vtoken/vllm/internals.py``): ``vllm.v1.sample.logits_processor
.AdapterLogitsProcessor`` (per-request callables ``(output_ids, logits) -> logits``), passed to the engine
as ``LLM(logits_processors=[TeacherForcing])``.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

TEACHER_KEY = "teacher"


def _forcer(teacher: tuple[int, ...]):
    def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_ids)
        if step >= len(teacher):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[teacher[step]] = 0.0
        return forced

    return force


class TeacherForcing(AdapterLogitsProcessor):
    """Forces ``extra_args["teacher"]`` token by token (module doc). Not argmax-invariant: it changes
    which token is sampled."""

    @classmethod
    def validate_params(cls, params) -> None:
        teacher = (params.extra_args or {}).get(TEACHER_KEY)
        if teacher is not None and not (
            isinstance(teacher, (list, tuple)) and all(isinstance(t, int) and t >= 0 for t in teacher)
        ):
            raise ValueError(f"extra_args[{TEACHER_KEY!r}] must be a list of token ids, got {teacher!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        teacher = (params.extra_args or {}).get(TEACHER_KEY)
        return _forcer(tuple(teacher)) if teacher else None
