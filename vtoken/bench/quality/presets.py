"""What ``vtoken bench quality`` measures unless its flags say otherwise, and how its list flags are read
(each item checked as ``VTokenConfig`` checks it; ``ConfigError`` names the flag and the item)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QualityPreset:
    """What ``vtoken bench quality`` measures unless its flags say otherwise (``--quick`` or the full sweep)."""

    policies: str  # comma-separated policy names, or "all"
    budgets: str  # comma-separated fractions or token counts
    depths: str  # pass-key depths, comma-separated fractions
    per_depth: int  # pass-key prompts per depth
    windows: int  # language-modelling text windows
    window_tokens: int  # tokens per window
    ruler_tasks: str  # comma-separated RULER task names, "all" or "none"
    ruler_lengths: str  # comma-separated RULER lengths (tokens)
    ruler_samples: int  # RULER samples per task × length
    fidelity_prompts: int  # long-generation fidelity prompts (0 skips it)
    fidelity_tokens: int  # tokens each fidelity prompt generates


QUALITY_PRESETS = {
    "quick": QualityPreset(
        "h2o,tova,snapkv,streamingllm",
        "0.2,0.5",
        "0.2,0.5,0.8",
        per_depth=1,
        windows=2,
        window_tokens=256,
        ruler_tasks="niah_single_1",
        ruler_lengths="512",
        ruler_samples=8,
        fidelity_prompts=2,
        fidelity_tokens=64,
    ),
    "full": QualityPreset(
        "all",
        "0.1,0.2,0.3,0.4,0.5",
        "0.1,0.3,0.5,0.7,0.9",
        per_depth=2,
        windows=4,
        window_tokens=512,
        ruler_tasks="all",
        ruler_lengths="512,1024",
        ruler_samples=50,
        fidelity_prompts=20,
        fidelity_tokens=256,
    ),
}


def count_setting(text: str, option: str, key: str) -> int:
    """One item of a comma-separated ``option`` (``--prompt-tails``, ``--score-pools``): a non-negative
    integer, checked as ``VTokenConfig``'s ``key`` (``ConfigError`` naming the option and the item)."""
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    try:
        n = int(text.strip())
    except ValueError:
        raise ConfigError(f"{option} {text.strip()!r}: give non-negative token counts") from None
    return getattr(VTokenConfig(**{key: n}), key)


def score_layers_of(text: str) -> int | None:
    """``--score-layers`` item: ``all`` → None (every layer), else a count (``ConfigError`` naming it)."""
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    text = text.strip()
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--score-layers {text!r}: give 'all' or a positive layer count") from None
    return VTokenConfig(score_layers=n).score_layers


def ruler_tasks_of(text: str) -> tuple[str, ...]:
    """'all' | 'none' | comma-separated RULER task names (ConfigError naming an unknown one)."""
    from vtoken.bench.quality.ruler_tasks import TASKS
    from vtoken.errors import ConfigError

    if text.strip() == "none":
        return ()
    names = tuple(TASKS) if text.strip() == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        if name not in TASKS:
            raise ConfigError(f"--tasks {name!r}: one of {', '.join(TASKS)}, 'all' or 'none'")
    return names


def ruler_lengths_of(text: str) -> tuple[int, ...]:
    from vtoken.errors import ConfigError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--lengths {text!r}: give comma-separated token counts") from None
    if not values or min(values) < 256:
        raise ConfigError(f"--lengths {text!r}: every length must be ≥ 256 tokens")
    return values
