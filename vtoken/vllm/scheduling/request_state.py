"""The vToken scheduler's state of one request, and the steps of it that are in flight.

With synchronous scheduling a step's output is processed before the next step is scheduled. With vLLM's
async scheduling (``AsyncScheduler``, the CUDA default) the next step is scheduled while the previous one
runs, so up to two steps of one request are in flight, and the table may be changed by a decision between
a step being scheduled and its scores arriving::

    schedule(N)    place p_N; record N: (first=p_N, live_N)                 → worker runs N
    schedule(N+1)  N unobserved: p_N.. protected from eviction; evict,      → worker runs N+1 after N
                   repack (record N freezes slot→token first); place p_N+1
    update(N)      N's scores: mapped through record N's slot→token map, never the current table
    update(N+1)    …

``InFlight`` keeps one ``StepRecord`` per step in flight, keyed by the scheduler's step number (echoed by
the worker in ``StepResult.step``). A record holds the step's first new logical position and its row length;
the slot→token map it was computed against is the table's own until a decision remaps slots (evict, reuse,
repack), when ``freeze`` copies it into the record first: scores are always attributed to the tokens they
were measured on. A preempted request's records are dropped with its table (the recomputation starts a new
table), so late scores for it are dropped; an aborted request's state goes altogether.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vtoken.core.scored_range import first_scored
from vtoken.core.step_stats import SlotScores, StepScores
from vtoken.core.token_table import TokenTable
from vtoken.errors import IntegrityError
from vtoken.policies import STEP_ATTENTION_STATS, ScorerPolicy, Stat
from vtoken.vllm.config import RequestSettings
from vtoken.vllm.scheduling.trace import RequestObserver


@dataclass
class StepRecord:
    """One scheduled step of one request whose output has not been processed yet."""

    first: int  # logical position of the step's first new token
    live: int  # row length the step's forward attends over (its scores' seq_len)
    scored: bool  # attention statistics expected (their slots need the step's slot→token map)
    token_at: np.ndarray | None = None  # the map as the step saw it, copied before a remap; else the table's


@dataclass
class InFlight:
    """A request's steps in flight, by step number (mutated by the scheduler)."""

    steps: dict[int, StepRecord] = field(default_factory=dict)

    def add(self, step: int, first: int, live: int, scored: bool) -> None:
        self.steps[step] = StepRecord(first, live, scored)

    def unobserved(self, seen: int) -> int:
        """Tokens placed by steps in flight (the last ones up to ``seen``): no statistics yet (pure)."""
        return seen - min(r.first for r in self.steps.values()) if self.steps else 0

    def freeze(self, table: TokenTable) -> None:
        """Copy the slot→token map into every scored record that still shares the table's (call before the
        table's slots are remapped)."""
        for r in self.steps.values():
            if r.scored and r.token_at is None:
                r.token_at = table.token_at[: r.live].copy()

    def take(self, step: int) -> StepRecord | None:
        """Remove and return the record of ``step`` (and any older one: its output can no longer come)."""
        rec = self.steps.pop(step, None)
        for s in [s for s in self.steps if s < step]:
            del self.steps[s]
        return rec

    def clear(self) -> None:
        self.steps.clear()


def step_scores(rid: str, rec: StepRecord, table: TokenTable, scores: SlotScores) -> StepScores:
    """``scores`` by logical position through the map the step ran with (pure). Raises ``IntegrityError`` if
    they do not describe that step's row (a misattributed result)."""
    if scores.seq_len != rec.live:
        raise IntegrityError(
            "4: logical positions",
            f"request {rid}: scores over {scores.seq_len} slots for a step of {rec.live} live tokens",
        )
    return scores.by_logical(rec.token_at if rec.token_at is not None else table.token_at, rec.first)


@dataclass
class RequestState:
    """vToken state of one request (the scheduler owns it; mutated every step)."""

    settings: RequestSettings
    policy: ScorerPolicy
    salt: int
    observer: RequestObserver
    want_attention: bool = False  # collect q·K statistics every step for its policy
    want_key_norm: bool = False
    want_window: bool = False  # collect the observation window on the step computing the prompt's last token
    want_redundancy: bool = False  # collect the live keys' redundancy with the attention statistics (R-KV)
    table: TokenTable | None = None  # None before its first step and after a preemption
    preplaced: np.ndarray | None = None  # reuse+repack: slot given to the next token before vLLM scheduled it
    inflight: InFlight = field(default_factory=InFlight)
    normed: int = 0  # KNorm: logical tokens of the table whose key norms a step has asked for
    score_all: bool = False  # the engine's ``scores: always``: every row slot is scored

    def live_table(self) -> TokenTable:
        """The request's token table, which every caller past its first step relies on (raises
        ``IntegrityError`` when there is none: before its first step or after a preemption). Pure."""
        if self.table is None:
            raise IntegrityError("4: logical positions", "a request with no token table reached a step decision")
        return self.table

    def drop_table(self) -> None:
        """Preemption: the table, the reservation and the steps in flight go (late scores are dropped)."""
        self.table, self.preplaced, self.normed = None, None, 0
        self.inflight.clear()

    def first_scored(self) -> int:
        """The first row slot a step of this table scores (``vtoken.core.scored_range``; the caller compares
        it with the step's live length: nothing to score below it). Needs the table. Pure."""
        return first_scored(self.settings.cfg, self.live_table().prompt_len, full=self.score_all)

    def norm_back(self, computed_before: int, n: int) -> int:
        """How many keys before this step's ``n`` new ones (logical ``computed_before ..``) need their norms
        too: the prefix-cache hits a fresh table starts with (also a resumed request's), which no step of
        this table computed. They sit in the row slots just before the new tokens (no eviction yet), so
        the worker reads them back from the cache with the new keys (``RequestStep.norm_back``), and the
        step's record starts at the first of them: they are protected like unobserved tokens until the
        norms arrive. 0 when the policy reads no key norms. Mutates ``normed``."""
        if not self.want_key_norm:
            return 0
        back, self.normed = computed_before - self.normed, computed_before + n
        return max(back, 0)


def new_request_state(rs: RequestSettings, salt: int, observer: RequestObserver, scores: str) -> RequestState:
    """A request's state for its settings ``rs`` and the engine's ``scores`` setting (auto/always/never)."""
    policy = rs.cfg.make_policy()
    evicts = rs.cfg.can_evict  # budget 1.0 (the default): nothing to score, the step runs as vLLM's own
    auto = evicts and scores == "auto"
    return RequestState(
        settings=rs,
        policy=policy,
        salt=salt,
        observer=observer,
        score_all=scores == "always",
        want_attention=scores == "always" or (auto and bool(policy.needs & STEP_ATTENTION_STATS)),
        want_key_norm=scores == "always" or (evicts and Stat.KEY_NORM in policy.needs),
        want_window=scores == "always" or (auto and Stat.WINDOW in rs.cfg.measured_stats()),
        want_redundancy=evicts and scores != "never" and Stat.REDUNDANCY in policy.needs,
    )
