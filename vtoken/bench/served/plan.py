"""What one ``vtoken bench serve`` command runs: the workload, the pool, the SLOs, the variants and repeats
(``ServeBenchSetup``). Pure data; ``served.bench`` runs it, ``served.measures`` summarises its runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

DATASETS = ("random", "chat")  # chat: a shared system prompt + lengths drawn ±50 % (a chat-like mix)
CHAT_RANGE_RATIO = 0.5  # chat: prompt and output lengths drawn from [(1 - r)·len, (1 + r)·len]
TOKENIZER_SLACK = 32  # vllm bench serve re-tokenizes its random prompts: a few tokens more than asked


class Variant(NamedTuple):
    """One server of the comparison: a reclamation mode, its policy (``None`` for ``none``: stock vLLM),
    SLO-aware admission on or off, and the eviction trigger (``step``: the budget applies at every step,
    as fixed; ``pressure``: only when the pool is short, the budget a floor)."""

    mode: str
    policy: str | None
    admission: bool
    trigger: str = "step"


@dataclass(frozen=True)
class ServeBenchSetup:
    model: str = "default"
    modes: tuple[str, ...] = ("none", "naive", "repack")
    policies: tuple[str, ...] = ("h2o",)
    budget: str = "0.2"
    pool_blocks: int = 64
    max_num_seqs: int = 16
    rates: tuple[float, ...] = (1.5,)
    num_prompts: int = 48
    input_len: int = 256
    output_len: int = 96
    dataset: str = "random"
    prefix_len: int = 128  # chat: shared system-prompt tokens
    ttft_ms: float = 15000.0
    tpot_ms: float = 300.0
    seed: int = 0  # the workload of repeat i is drawn with seed + i (``repeat_seed``)
    burstiness: float = 1.0  # arrivals: 1 Poisson; < 1 gamma intervals, bursts above the mean rate
    range_ratio: float = 0.0  # random dataset: lengths uniform in (1 ± range_ratio) × input/output_len
    admission: tuple[bool, ...] = (False,)  # SLO-aware admission per variant: off, on, or both (an A/B)
    triggers: tuple[str, ...] = ("step",)  # eviction triggers per evicting variant: step (fixed), pressure
    stop_after_misses: int = 0  # a variant's sweep stops once this many rates in a row missed (0: every rate)
    repeats: int = 1  # every variant this many times, all in one command; ratios per repeat (summary)
    extra: tuple[str, ...] = field(default_factory=tuple)  # more ``--set key=value`` for every server

    def longest_request(self) -> int:
        """Prompt + generated tokens of the longest request the client sends (the engine's
        ``max_model_len``): ``chat`` draws prompts up to 1.5 × ``input_len`` after the shared prefix, and
        the prompts' decode/re-encode round trip may add a few tokens."""
        prompt = (
            self.prefix_len + self._widest(self.input_len) if self.dataset == "chat" else self._widest(self.input_len)
        )
        return prompt + TOKENIZER_SLACK + self.longest_output() + 1

    def longest_output(self) -> int:
        """The largest ``max_tokens`` the client asks for (the server's ``limits.max_tokens``): ``chat``
        draws outputs up to (1 + ``CHAT_RANGE_RATIO``) × ``output_len``."""
        return self._widest(self.output_len)

    def spread(self) -> float:
        """How far request lengths range around ``input_len`` / ``output_len`` (pure): chat's fixed ratio, else
        ``range_ratio``."""
        return CHAT_RANGE_RATIO if self.dataset == "chat" else self.range_ratio

    def _widest(self, length: int) -> int:
        return math.ceil(length * (1 + self.spread()))

    def repeat_seed(self, repeat: int) -> int:
        """The ``vllm bench serve --seed`` of repeat ``repeat`` (0-based; pure): every repeat replays another
        workload, so the spread over repeats measures workloads, not only timing noise; repeat 0 is
        ``seed`` itself, so a one-repeat run replays the workload earlier reports ran."""
        return self.seed + repeat

    def variants(self) -> list[Variant]:
        """The servers to run (pure). ``none`` is stock vLLM, the baseline: no policy, no admission (no vToken
        class in the engine); whenever the evicting variants run with admission, stock vLLM also runs with
        the same admission cap as its own variant ``none +admission`` (the control: what admission alone
        buys). Each evicting (mode, policy) once per trigger and per ``admission`` setting, off before on."""
        switches = sorted(set(self.admission))
        out: list[Variant] = []
        if "none" in self.modes:
            out += [Variant("none", None, False)] + ([Variant("none", None, True)] if True in switches else [])
        pairs = [(m, p) for m in self.modes if m != "none" for p in self.policies]
        return out + [Variant(m, p, a, t) for m, p in pairs for t in self.triggers for a in switches]
