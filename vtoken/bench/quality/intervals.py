"""Confidence intervals for the quality bench: "parity with the full cache" is a statistical statement.

Wilson's score interval for a success rate (good at small n and near 0 or 1, where the normal
approximation of lm-eval's ``± stderr`` is not); a point is at parity on a task when its rate lies
inside the full cache's 95 % interval. Pure functions.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the two-sided 95 % normal quantile


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of ``successes`` in ``n`` trials.

    Raises ``ValueError`` when ``n`` < 1 or ``successes`` is outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson({successes}, {n}): need n ≥ 1 and 0 ≤ successes ≤ n")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def rate(successes: int, n: int) -> dict:
    """``{"solved", "n", "rate", "ci95"}`` — the block every task result carries."""
    low, high = wilson(successes, n)
    return {"solved": successes, "n": n, "rate": round(successes / n, 4), "ci95": [round(low, 4), round(high, 4)]}


def inside(value: float, interval: list[float] | tuple[float, float]) -> bool:
    """``value`` within ``interval`` (closed)."""
    return interval[0] <= value <= interval[1]
