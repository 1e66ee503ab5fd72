"""Per-request traces: which tokens each forward step could see, for the HF masked reference.

A request's life is one or more *epochs* (a new one after every preemption, which recomputes the whole
sequence from its logical tokens). Within an epoch, every forward step that computes tokens of the
request is a *round* r = 0, 1, 2, …; ``placed_round[p]`` is the round that computed token p and
``evicted_round[j]`` the round *before* which token j was evicted (-1: never). So, in that epoch::

    query p sees key j  ⇔  j ≤ p  and  (evicted_round[j] == -1  or  placed_round[p] < evicted_round[j])

Prefix-cache hits are computed tokens of round 0 (they were computed with full visibility: a request
stops publishing hashes at its first eviction). ``start`` is the first position the epoch computes for the
first time: the sampled token at position ``q + 1`` comes from query ``q`` of the epoch whose
``start ≤ q`` is largest.

The file is JSON (small: ints per token), written when the request finishes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

NEVER = -1
logger = logging.getLogger("vtoken.vllm")


@dataclass
class Epoch:
    start: int
    hits: int = 0  # prefix-cache hit tokens at the epoch's first step
    placed_round: list[int] = field(default_factory=list)
    evicted_round: list[int] = field(default_factory=list)

    def place(self, first: int, n: int, rnd: int) -> None:
        if first != len(self.placed_round):
            raise ValueError(f"trace: placing token {first} but {len(self.placed_round)} are placed")
        self.placed_round.extend([rnd] * n)
        self.evicted_round.extend([NEVER] * n)

    def evict(self, logicals: np.ndarray, rnd: int) -> None:
        for j in np.asarray(logicals).tolist():
            self.evicted_round[j] = rnd

    def mask(self, n: int | None = None) -> np.ndarray:
        """bool ``[n, n]``: query p may attend key j (the epoch's first ``n`` tokens)."""
        placed = np.asarray(self.placed_round, dtype=np.int64)
        ev = np.asarray(self.evicted_round, dtype=np.int64)
        n = placed.size if n is None else n
        placed, ev = placed[:n], ev[:n]
        causal = np.tri(n, dtype=bool)
        alive = (ev[None, :] == NEVER) | (placed[:, None] < ev[None, :])
        return causal & alive


def trace_file_name(trace_id: str) -> str:
    """The file a trace id is written to: characters other than letters, digits and ``-_.+`` become ``_``."""
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in trace_id) + ".json"


@dataclass
class RequestTrace:
    request_id: str
    trace_id: str | None
    policy: str
    mode: str
    budget: str
    block_size: int
    prompt_len: int
    epochs: list[Epoch] = field(default_factory=list)
    held_blocks: list[int] = field(default_factory=list)  # per scheduled step, after allocation
    packing_bound: list[int] = field(default_factory=list)
    naive_blocks: list[int] = field(default_factory=list)
    live_tokens: list[int] = field(default_factory=list)
    engine_steps: list[int] = field(default_factory=list)  # the engine's step counter at each round
    moves: int = 0
    evicted: int = 0
    shared_blocks_max: int = 0  # most leading blocks shared with other requests at a decision
    cow_moves: int = 0  # of ``moves``: copies that kept prefix-cached blocks intact (vtoken/core/cow.py)
    cow_blocks: int = 0  # prefix-cached blocks replaced instead of rewritten

    def new_epoch(self, start: int) -> Epoch:
        ep = Epoch(start=start)
        self.epochs.append(ep)
        return ep

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestTrace:
        raw = json.loads(text)
        raw["epochs"] = [Epoch(**e) for e in raw["epochs"]]
        return cls(**raw)

    def file_name(self) -> str:
        return trace_file_name(self.trace_id or self.request_id)

    def write(self, directory: str | os.PathLike) -> Path:
        """Atomic write into ``directory`` (created if missing)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        target = d / self.file_name()
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(self.to_json())
        os.replace(tmp, target)
        return target

    @classmethod
    def read_id(cls, directory: str | os.PathLike, trace_id: str) -> RequestTrace:
        """The trace written for ``trace_id`` into ``directory`` (its name made file-safe, as ``write`` does)."""
        return cls.read(Path(directory) / trace_file_name(trace_id))

    @classmethod
    def read(cls, path: str | os.PathLike) -> RequestTrace:
        return cls.from_json(Path(path).read_text())

    def epoch_of_query(self, q: int) -> Epoch:
        """The epoch whose forward produced the token sampled from query position ``q``."""
        best = self.epochs[0]
        for ep in self.epochs:
            if ep.start <= q:
                best = ep
        return best


class RequestObserver:
    """What the scheduler reports about one request, step by step. This base ignores everything (the
    observer of a request nobody traces); ``TraceRecorder`` writes it into a ``RequestTrace``."""

    def new_table(self, computed_before: int) -> None:
        """A fresh token table (first step, or after a preemption); ``computed_before`` prefix-cache hits."""

    def decided(
        self, victims: np.ndarray, moves: int, shared_blocks: int, cow_moves: int = 0, cow_blocks: int = 0
    ) -> None:
        """A decision evicted ``victims`` and moved ``moves`` slots (``cow_moves`` of them to keep
        ``cow_blocks`` prefix-cached blocks intact), with ``shared_blocks`` protected."""

    def placed(self, first: int, n: int) -> None:
        """This step computes logical tokens ``first .. first + n - 1`` (one forward round)."""

    def stepped(self, held_blocks: int, table, engine_step: int) -> None:
        """The request's blocks and table after this step's allocation."""

    def finished(self) -> None:
        """The request left the engine (finished, aborted)."""


class TraceRecorder(RequestObserver):
    """Records one request into ``self.trace``; ``finished`` writes it into ``trace_dir`` (a failed write
    is logged, never raised: a trace must not take the engine down). Mutates ``self.trace`` only."""

    def __init__(self, trace: RequestTrace, trace_dir: str | os.PathLike) -> None:
        self.trace = trace
        self.trace_dir = trace_dir
        self.rounds = 0  # forward rounds of the current epoch

    def new_table(self, computed_before: int) -> None:
        prev = self.trace.epochs
        ep = self.trace.new_epoch(0 if not prev else len(prev[-1].placed_round))
        self.rounds = 0
        if computed_before:  # prefix-cache hits: computed with full visibility, in round 0
            ep.place(0, computed_before, 0)
            ep.hits = computed_before

    def decided(
        self, victims: np.ndarray, moves: int, shared_blocks: int, cow_moves: int = 0, cow_blocks: int = 0
    ) -> None:
        t = self.trace
        t.cow_moves += cow_moves
        t.cow_blocks += cow_blocks
        t.shared_blocks_max = max(t.shared_blocks_max, shared_blocks)
        t.epochs[-1].evict(victims, self.rounds)
        t.evicted += int(victims.size)
        t.moves += moves

    def placed(self, first: int, n: int) -> None:
        self.trace.epochs[-1].place(first, n, self.rounds)
        self.rounds += 1

    def stepped(self, held_blocks: int, table, engine_step: int) -> None:
        t = self.trace
        t.held_blocks.append(held_blocks)
        t.packing_bound.append(table.packing_bound())
        t.naive_blocks.append(table.naive_blocks())
        t.live_tokens.append(table.live)
        t.engine_steps.append(engine_step)

    def finished(self) -> None:
        if not self.trace.epochs:  # never scheduled (aborted while waiting): nothing to replay
            return
        try:
            self.trace.write(self.trace_dir)
        except OSError as e:
            logger.warning("vToken: could not write trace of %s: %s", self.trace.request_id, e)
