"""The trade per model: what a setting costs in quality against what it gains over stock vLLM (pure data).

Quality comes from the yardstick's two halves — ``vtoken bench longgen`` (perplexity ratio on human text,
95 % interval) and ``vtoken bench codegen`` (HumanEval accuracy difference, one-sided 95 % lower bound).
Gain comes in two kinds, never mixed:

* **capacity gain** (every point): full-cache blocks ÷ blocks the point holds, mean over decode steps of
  the same run — how many more such requests one KV pool holds; the served gain's ceiling when memory binds;
* **served gain** (where measured): ``vtoken bench serve``'s median ratio repack ÷ stock vLLM of the highest
  rate meeting the SLOs, min–max over repeats, matched to a point by (policy, budget, scope).
"""

from __future__ import annotations

SAME_RUN_KEYS = ("prompt_tokens", "continuation_tokens", "block_size")  # what merged reports must share


def merged_points(reports: list[dict]) -> list[dict]:
    """Every point of ``reports`` with ``blocks_ratio`` (held ÷ full cache); ``ValueError`` naming the first
    report whose model or shape differs from the first's. Pure."""
    first = reports[0]
    out = []
    for r in reports:
        if r["model"] != first["model"] or any(r["setup"][k] != first["setup"][k] for k in SAME_RUN_KEYS):
            raise ValueError(f"report {r['command']!r} is not on the first report's model and shape")
        full = r["full_cache"]["blocks_mean"]
        out += [{**p, "blocks_ratio": p["retained_blocks_mean"] / full} for p in r["points"]]
    return out


MATCH_KEYS = ("policy", "budget", "scope")  # what ties a served run to a yardstick point
SERVED_RATIO = "repack/{policy} +admission / none"  # the served summary's repack ÷ stock ratio


def text_points(longgen: list[dict]) -> list[dict]:
    """Each longgen point as ``{label, settings, gain, ratio, ci95, at_parity}``; ``gain`` = 1 ÷ blocks ratio."""
    return [
        {
            "label": p["label"],
            "settings": p["settings"],
            "gain": 1.0 / p["blocks_ratio"],
            "ratio": p["perplexity_ratio"],
            "ci95": p["perplexity_ratio_ci95"],
            "at_parity": p["verdict"]["at_parity"],
        }
        for p in merged_points(longgen)
    ]


def task_points(codegen: list[dict]) -> list[dict]:
    """Each codegen point as ``{label, settings, gain, difference, lower95, task_ok}`` (gain from its own run's
    blocks: full cache's ÷ the point's)."""
    out = []
    for r in codegen:
        full = r["full_cache"]["retained_blocks_mean"]
        out += [
            {
                "label": p["label"],
                "settings": p["settings"],
                "gain": full / p["retained_blocks_mean"],
                "difference": p["difference"],
                "lower95": p["lower95"],
                "task_ok": p["task_ok"],
            }
            for p in r["points"]
        ]
    return out


def served_settings(report: dict) -> dict:
    """A served run's evicting setting: ``{policy, budget, scope}`` from its setup (``--set vtoken.scope=…``
    in ``extra``; the served default scope is ``all``)."""
    setup = report["setup"]
    (policy,) = setup["policies"]
    extra = dict(e.removeprefix("vtoken.").split("=", 1) for e in setup.get("extra", []) if e.startswith("vtoken."))
    return {"policy": policy, "budget": float(setup["budget"]), "scope": extra.get("scope", "all")}


def served_gains(served: list[dict]) -> list[dict]:
    """Each served report as ``{settings, pool_blocks, median, low, high, lower_bound}`` (repack ÷ stock)."""
    out = []
    for r in served:
        s = served_settings(r)
        ratio = r["summary"]["ratios"][SERVED_RATIO.format(policy=s["policy"])]["max_rate_at_target"]
        bound = r["summary"]["ratios"][SERVED_RATIO.format(policy=s["policy"])].get("lower_bounds", 0)
        out.append(
            {
                "settings": s,
                "pool_blocks": r["setup"]["pool_blocks"],
                "median": ratio["median"],
                "low": ratio["min"],
                "high": ratio["max"],
                "lower_bound": bound == ratio["n"],
            }
        )
    return out


def matches(settings: dict, served_setting: dict) -> bool:
    """Whether a yardstick point's settings are the served run's (``MATCH_KEYS``). Pure."""
    return all(str(settings[k]) == str(served_setting[k]) for k in MATCH_KEYS)


def gain_at_parity(points: list[dict], served: list[dict]) -> dict:
    """The sentence's numbers: among points at parity, the largest capacity gain and the largest measured
    served gain (1.0 when none evicts or none at parity was served)."""
    ok = [p for p in points if p["at_parity"]]
    served_ok = [g["median"] for g in served if any(matches(p["settings"], g["settings"]) for p in ok)]
    return {
        "capacity_gain": round(max((p["gain"] for p in ok), default=1.0), 3),
        "served_gain": max(served_ok, default=1.0),
        "points_at_parity": [p["label"] for p in ok],
    }
