"""``vtoken bench serve --repeats N``: the headline numbers as medians of repeats, with their spread.

One repeat runs every variant once, in one command, on one pool; ratios are computed *within* a repeat (the
same hour of the machine for both sides), then summarised over the repeats::

    repeat 1   none 0.20  naive/h2o 0.15  repack/h2o 0.30   → repack/h2o ÷ none = 1.50, ÷ naive = 2.00
    repeat 2   none 0.25  naive/h2o 0.20  repack/h2o 0.30   →                   1.20,           1.50
    repeat 3   none 0.20  naive/h2o 0.20  repack/h2o 0.35   →                   1.75,           1.75
    summary    repack/h2o ÷ none: median 1.50 (min 1.20, max 1.75, 3 of 3 repeats)

The baselines of an evicting variant are stock vLLM (``none`` without admission: no vToken class in the
engine), stock vLLM with the same admission cap where the variant runs admission (``none +admission``), and
Naive-Evict with the same policy and admission setting. A variant that met no rate (it missed
the lowest one) counts as 0 against a baseline that met one: its ratio is 0, a loss, never left out. A ratio
over a baseline that met no rate is ``None`` (undefined, not infinite) and is left out of the median; ``n``
says how many repeats it covers. A variant that met the highest rate it ran (the grid's top: it never
missed) has no measured limit, only a lower bound; a ratio with such a numerator is a lower bound too
(``lower_bounds`` counts those repeats, and the headline writes "≥" when every repeat is one). All pure.
"""

from __future__ import annotations

import statistics

from vtoken.bench.served.measures import variant_label
from vtoken.bench.served.plan import Variant

RATE_KEYS = ("max_rate_at_target", "rate_at_target_interpolated")
STOCK = Variant("none", None, False)  # the baseline: stock vLLM, no vToken class loaded, no admission


def spread(values: list[float | None]) -> dict:
    """``{"median", "min", "max", "n", "values"}`` over the numbers in ``values`` (``None`` entries kept in
    ``values``, left out of the rest; all ``None`` → median/min/max ``None``)."""
    nums = [v for v in values if v is not None]
    if not nums:
        return {"median": None, "min": None, "max": None, "n": 0, "values": values}
    return {
        "median": round(statistics.median(nums), 4),
        "min": round(min(nums), 4),
        "max": round(max(nums), 4),
        "n": len(nums),
        "values": values,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; ``a`` missing (met no rate) counts as 0, ``b`` missing or 0 makes it undefined."""
    return None if not b else round((a or 0.0) / b, 4)


def _key(v: dict) -> Variant:
    return Variant(v["mode"], v["policy"], bool(v["admission"]), v.get("trigger", "step"))


def at_grid_top(v: dict | None) -> bool:
    """The variant met the highest rate it ran: its max rate is a lower bound, not its limit."""
    runs = (v or {}).get("runs") or []
    return (
        bool(runs)
        and v.get("max_rate_at_target") is not None
        and v["max_rate_at_target"] >= max(r["rate"] for r in runs)
    )


def baselines(variant: Variant) -> list[tuple[str, Variant]]:
    """``[(name, baseline variant)]`` a variant is compared with (pure): stock vLLM; with admission, stock
    vLLM with the same cap (the control); Naive-Evict with the same policy, trigger and admission; and for a
    ``pressure`` variant the same mode with the fixed budget (``fixed``: what evicting only when short buys)."""
    mode, policy, admission, trigger = variant
    if mode == "none":
        return [("stock", STOCK)] if admission else []
    out = [("stock", STOCK)]
    if admission:  # the control: stock vLLM with the same admission cap
        out.append(("stock+admission", Variant("none", None, True)))
    if mode != "naive":
        out.append(("naive", Variant("naive", policy, admission, trigger)))
    if trigger != "step":
        out.append(("fixed", Variant(mode, policy, admission, "step")))
    return out


def summarize(repeats: list[list[dict]]) -> dict:
    """Per variant label: each rate key's ``spread`` over the repeats; per (variant, baseline) pair present in
    every repeat: the within-repeat ratios' ``spread``. ``repeats``: each repeat's variant reports (as
    ``run_variant`` returns them)."""
    by_repeat = [{_key(v): v for v in rep} for rep in repeats]
    order = [_key(v) for v in repeats[0]] if repeats else []
    variants, ratios = {}, {}
    for key in order:
        label = variant_label(*key)
        variants[label] = {k: spread([rep[key][k] if key in rep else None for rep in by_repeat]) for k in RATE_KEYS}
        for name, base in baselines(key):
            if base not in by_repeat[0]:
                continue
            ratios[f"{label} / {variant_label(*base)}"] = {
                "baseline": name,
                **{
                    k: spread([_ratio(rep.get(key, {}).get(k), rep.get(base, {}).get(k)) for rep in by_repeat])
                    for k in RATE_KEYS
                },
                "lower_bounds": sum(
                    at_grid_top(rep.get(key))
                    and not at_grid_top(rep.get(base))
                    and bool(rep.get(base, {}).get("max_rate_at_target"))
                    for rep in by_repeat
                ),
            }
    return {"repeats": len(repeats), "variants": variants, "ratios": ratios}


def headline(summary: dict) -> list[str]:
    """One line per ratio: ``label: median× (min–max, n of N)`` of the max rate at the target (pure)."""
    lines = []
    for name, r in summary["ratios"].items():
        s = r["max_rate_at_target"]
        if s["median"] is None:
            lines.append(f"{name}: undefined (the baseline met no rate in any repeat)")
        else:
            bounds = r.get("lower_bounds", 0)
            lines.append(
                f"{name}: {'≥ ' if bounds == s['n'] else ''}{s['median']:g}× (min {s['min']:g}, "
                f"max {s['max']:g}; {s['n']} of {summary['repeats']} repeats"
                + (f"; {bounds} a lower bound: met the grid's top)" if 0 < bounds < s["n"] else ")")
            )
    return lines
