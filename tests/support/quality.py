"""Quality-bench settings shared by the tests of `vtoken bench quality` (the report's keys, score layers)."""

from __future__ import annotations


def small_quality_setup(**fields):
    """The smallest ``QualitySetup``: model "m", H2O at a 20 % token budget, one retrieval case at half depth
    in 64 tokens, one 64-token language-modelling window read in chunks of 16; ``fields`` replace any of
    those or set others."""
    from vtoken.bench.quality.bench import QualitySetup

    small = dict(
        model="m",
        policies=("h2o",),
        budgets=(0.2,),
        granularities=("token",),
        depths=(0.5,),
        per_depth=1,
        context_tokens=64,
        windows=1,
        window_tokens=64,
        chunk=16,
    )
    return QualitySetup(**{**small, **fields})
