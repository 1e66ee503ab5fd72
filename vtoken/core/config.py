"""Frozen configuration of vToken: reclamation mode, budget, protection, trigger.

Everything here is validated on construction and names the bad value in its error, so a typo in a
CLI flag or in vLLM's ``--additional-config`` fails at start-up, not mid-request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class ConfigError(ValueError):
    """A vToken setting has an invalid value; the message names the setting and the value."""


class Mode(str, Enum):
    """Reclamation mode (ARCHITECTURE §3). One mechanism, four accountings.

    ``none``          no eviction at all, vanilla paging: a request holds ceil(seen/B) blocks.
    ``naive``         paired baseline: same victims as ``repack``; a block returns to the pool only when
                      every token originally placed in it is dead.
    ``repack``        vToken: holes below ``live`` are filled from the tail; a request holds ceil(live/B).
    ``reuse+repack``  new tokens are written into holes first (zero copies), the tail fills the rest.
    """

    NONE = "none"
    NAIVE = "naive"
    REPACK = "repack"
    REUSE_REPACK = "reuse+repack"

    @property
    def evicts(self) -> bool:
        return self is not Mode.NONE

    @property
    def reuses_holes(self) -> bool:
        return self is Mode.REUSE_REPACK

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        if isinstance(value, Mode):
            return value
        try:
            return cls(str(value))
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown reclamation mode {value!r}; valid modes: {valid}") from None


class Trigger(str, Enum):
    """When eviction (and so a repack) runs.

    ``step``   every step in which the request is over budget (one small plan per step).
    ``block``  only when the request is at least one block over budget; it then evicts down to the
               budget, so every plan frees whole blocks and moves are batched.
    """

    STEP = "step"
    BLOCK = "block"

    @classmethod
    def parse(cls, value: str | Trigger) -> Trigger:
        if isinstance(value, Trigger):
            return value
        try:
            return cls(str(value))
        except ValueError:
            valid = ", ".join(t.value for t in cls)
            raise ConfigError(f"unknown repack trigger {value!r}; valid triggers: {valid}") from None


@dataclass(frozen=True)
class Budget:
    """How many tokens a request may keep: a fixed count, or a fraction of the context seen so far.

    A fraction ``f`` keeps ``ceil(f * seen)`` tokens at every step (H2O's definition: the budget grows
    with the sequence). Protected tokens (sinks, recent window, shared prefix blocks) are never evicted,
    so a request may stay above a budget smaller than its protected set.
    """

    count: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.fraction is None):
            raise ConfigError("budget needs exactly one of a token count or a fraction")
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ConfigError(f"budget count must be a positive integer, got {self.count!r}")
        if self.fraction is not None and not (0.0 < self.fraction <= 1.0 and math.isfinite(self.fraction)):
            raise ConfigError(f"budget fraction must be in (0, 1], got {self.fraction!r}")

    @classmethod
    def parse(cls, value: str | float | int | Budget) -> Budget:
        """``"0.2"``/``0.2`` → 20% of the context; ``"512"``/``512`` → 512 tokens."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"invalid budget {value!r}: give a fraction in (0, 1] or a token count")
        if isinstance(value, int):
            return cls(count=value)
        if isinstance(value, float):
            return cls(fraction=value)
        text = str(value).strip()
        try:
            return cls(count=int(text)) if text.lstrip("+-").isdigit() else cls(fraction=float(text))
        except ValueError:  # also ConfigError from the range checks
            raise ConfigError(
                f"invalid budget {value!r}: give a fraction in (0, 1] (e.g. 0.2) or a positive token count "
                "(e.g. 512)"
            ) from None

    def tokens(self, seen: int) -> int:
        """Tokens a request that has seen ``seen`` tokens may keep (never more than ``seen``)."""
        if self.count is not None:
            return min(self.count, seen)
        return min(seen, math.ceil(self.fraction * seen - 1e-9))

    def __str__(self) -> str:
        return str(self.count) if self.count is not None else f"{self.fraction:g}"


@dataclass(frozen=True)
class VTokenConfig:
    """Static vToken settings for one engine (one block size, one policy, one mode).

    ``sinks``: the first ``sinks`` logical tokens are never evicted (attention sinks).
    ``recent``: the last ``recent`` logical tokens are never evicted (recent window).
    """

    policy: str = "h2o"
    budget: Budget = Budget(fraction=0.5)
    mode: Mode = Mode.REPACK
    block_size: int = 32
    sinks: int = 4
    recent: int = 16
    trigger: Trigger = Trigger.STEP
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "trigger", Trigger.parse(self.trigger))
        check_block_size(self.block_size)
        for name in ("sinks", "recent", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        # Imported here: policies depend on core, not the other way round at import time.
        from vtoken.policies import get_policy_class

        get_policy_class(self.policy)

    def make_policy(self):
        """A fresh policy instance for this config (policies are frozen dataclasses)."""
        from vtoken.policies import make_policy

        return make_policy(self.policy, seed=self.seed)


def check_block_size(block_size: object) -> int:
    """Block sizes are positive powers of two (vLLM's CPU backend further needs a multiple of 32)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
    if block_size & (block_size - 1):
        raise ConfigError(f"block size must be a power of two, got {block_size}")
    return block_size
