"""Eviction policies. Importing this package registers every policy in ``REGISTRY``."""

# importing a policy's module registers it
from vtoken.policies import h2o, knorm, random, rkv, scissorhands, snapkv, streamingllm, tova  # noqa: F401
from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import (
    ATTENTION_STATS,
    HISTORY_BITS,
    OBSERVATION_WINDOW,
    STEP_ATTENTION_STATS,
    EvictionContext,
    Stat,
)
from vtoken.policies.registry import REGISTRY, register_policy


def get_policy_class(name: str) -> type[ScorerPolicy]:
    """The class registered as ``name``; raises ``ConfigError`` listing valid names otherwise."""
    return REGISTRY.get(name)


def make_policy(name: str, seed: int = 0, pool: int = 0) -> ScorerPolicy:
    """A fresh instance of the policy registered as ``name`` (``seed``: the random policy's; ``pool``: span
    pooling, ``ScorerPolicy.pool``)."""
    return REGISTRY.get(name)(seed=seed, pool=pool)


def policy_names() -> list[str]:
    return REGISTRY.names()


__all__ = [
    "ATTENTION_STATS",
    "HISTORY_BITS",
    "OBSERVATION_WINDOW",
    "STEP_ATTENTION_STATS",
    "EvictionContext",
    "Stat",
    "ScorerPolicy",
    "REGISTRY",
    "register_policy",
    "get_policy_class",
    "make_policy",
    "policy_names",
]
