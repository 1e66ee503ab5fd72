"""``vtoken bench quality``: what eviction costs in answers, against the KV blocks vLLM really holds.

Every point (policy × granularity × budget) runs through the real engine with the embedded SmolLM2-135M-
Instruct (never random weights): all points of a task are concurrent requests of one in-process engine,
each with its settings in ``SamplingParams.extra_args`` and its own trace (``held_blocks`` per step, read
from vLLM's block rows — the retained-block figure of every point comes from there).

* retrieval: every prompt is prefilled in one step (chunked prefill off, so concurrent requests never
  split one), then the policy evicts down to the budget before the answer is generated (post-prefill
  compression, SnapKV's setting) and keeps evicting as the answer grows (decode-time eviction);
* language modelling: the window is fed in chunks of ``chunk`` tokens (``max_num_batched_tokens``), so
  the policy evicts between chunks during the prefill; the prompt log-probabilities of every token give
  the perplexity (they are exact under eviction: tests/integration/test_bench_quality.py compares them with the
  masked Hugging Face reference).

Token granularity runs in ``repack`` mode (blocks held = ⌈live/B⌉); block granularity evicts whole
original blocks and runs in ``naive`` mode (a block-level engine frees the block itself, no repacking),
so both are charged what a real engine would hold. The full cache (mode ``none``) is the reference line.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, fields, replace

from vtoken.bench.quality.fidelity import run_fidelity
from vtoken.bench.quality.intervals import rate
from vtoken.bench.quality.requests import blocks_summary, run_on_engine
from vtoken.bench.quality.ruler import run_ruler
from vtoken.bench.quality.tasks import passkey_cases, perplexity, text_windows
from vtoken.bench.report import command_line
from vtoken.core.config import DEFAULT_SCORE_LAYERS, Scope, VTokenConfig

# The one base config every point overrides (``Point.config``): the engine's defaults, but every token may be
# evicted (scope all) and every attention layer scores (score_layers null), the bench's settings since its first
# report; a point's setting fields default to these values (older reports lack the keys they add).
BASE = VTokenConfig(scope=Scope.ALL, score_layers=None)


@dataclass(frozen=True)
class QualitySetup:
    """What one run measures (``quick`` and full presets in ``vtoken.bench.quality.presets``)."""

    model: str
    policies: tuple[str, ...]
    budgets: tuple[float | int, ...]
    granularities: tuple[str, ...]
    depths: tuple[float, ...]
    per_depth: int
    context_tokens: int
    windows: int
    window_tokens: int
    chunk: int
    seed: int = 0
    block_size: int = BASE.block_size
    sinks: int = BASE.sinks
    recent: int = BASE.recent
    answer_tokens: int = 12
    tensor_parallel_size: int = 1  # > 1: vLLM's multiprocess executor (start_engine)
    score_layers: tuple[int | None, ...] = (DEFAULT_SCORE_LAYERS,)  # each point once per value (None: every layer)
    prompt_tails: tuple[int, ...] = (0,)  # VTokenConfig.prompt_tail: each point once per value
    scopes: tuple[str, ...] = ("all",)  # VTokenConfig.scope: each point once per value
    prompt_scores: tuple[str, ...] = ("all",)  # VTokenConfig.prompt_scores: each point once per value
    keep_masses: tuple[float | None, ...] = (None,)  # VTokenConfig.keep_mass: each point once per value
    score_pools: tuple[int, ...] = (0,)  # VTokenConfig.score_pool: each point once per value
    ruler_tasks: tuple[str, ...] = ()  # RULER-style tasks (ruler_tasks.TASKS); () skips them
    ruler_lengths: tuple[int, ...] = (1024,)  # each task at each length (prompt + lm-eval's answer budget)
    ruler_samples: int = 50
    fidelity_prompts: int = 0  # long-generation fidelity: prompts (0 skips it)
    fidelity_prompt_tokens: int = 32
    fidelity_tokens: int = 256

    def base(self) -> VTokenConfig:
        """The config every point overrides (``Point.config``): ``BASE`` with this run's engine settings."""
        return replace(BASE, block_size=self.block_size, sinks=self.sinks, recent=self.recent)


@dataclass(frozen=True)
class Point:
    """One configuration: overrides of ``BASE`` (``config``; the fields are ``VTokenConfig``'s, documented there,
    their defaults ``BASE``'s). ``mode`` follows from the granularity (token → repack, block → naive)."""

    policy: str
    granularity: str
    budget: float | int | None  # None: the full cache
    score_layers: int | None = BASE.score_layers
    prompt_tail: int = BASE.prompt_tail
    scope: str = BASE.scope.value
    prompt_scores: str = BASE.prompt_scores.value
    keep_mass: float | None = BASE.keep_mass
    score_pool: int = BASE.score_pool

    def config(self, base: VTokenConfig = BASE) -> VTokenConfig:
        """``base`` with this point's settings (``dataclasses.replace``: validated as on construction); the full
        cache's point is mode ``none``. Raises ``ConfigError`` naming a bad value."""
        over = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "budget"}
        budget = base.budget if self.budget is None else self.budget
        return replace(base, **over, budget=budget, mode=self.mode)

    @property
    def mode(self) -> str:
        if self.budget is None:
            return "none"
        return "naive" if self.granularity == "block" else "repack"

    @property
    def key(self) -> str:
        tail = "" if self.score_layers is None else f"@{self.score_layers}"
        tail += f"_tail{self.prompt_tail}" if self.prompt_tail else ""
        tail += f"_{self.scope}" if self.scope != "all" else ""
        tail += f"_q{self.prompt_scores}" if self.prompt_scores != "all" else ""
        tail += f"_m{self.keep_mass:g}" if self.keep_mass is not None else ""
        tail += f"_pool{self.score_pool}" if self.score_pool else ""
        return f"{self.policy}_{self.granularity}_{self.budget}{tail}"

    def extra(self, trace_id: str, salt: int) -> dict:
        vt = {"policy": self.policy, "mode": self.mode, "trace_id": trace_id, "salt": salt}
        if self.budget is not None:
            vt["budget"] = self.budget
        if self.granularity != "token":
            vt["granularity"] = self.granularity
        vt["score_layers"] = self.score_layers  # None: every layer (explicit, the engine default is fewer)
        if self.prompt_tail:
            vt["prompt_tail"] = self.prompt_tail
        vt["scope"] = self.scope  # explicit: the engine default (generated) is not the bench's (all)
        if self.prompt_scores != "all":
            vt["prompt_scores"] = self.prompt_scores
        if self.keep_mass is not None:
            vt["keep_mass"] = self.keep_mass
        if self.score_pool:
            vt["score_pool"] = self.score_pool
        return {"vtoken": vt}


FULL = Point("h2o", "token", None)
# what makes a point a setting, besides its budget (Point's fields, with their defaults for older reports)
SETTING_DEFAULTS = {f.name: f.default for f in fields(Point) if f.name != "budget"}

# the top-level keys ``run_quality`` returns; the CLI adds ``plot`` with ``--plot`` and ``report.emit`` adds
# ``environment`` (tests/integration/test_bench.py holds the builder and the committed quality-*.json to them)
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "model",
        "setup",
        "full_cache",
        "points",
        "retrieval",
        "language_modelling",
        "ruler",
        "fidelity",
        "parity",
        "seconds",
    }
)


# what ``--set vtoken.KEY=VALUE`` sets in a quality run: an engine setting (``QualitySetup``'s field) or a point's
# setting, then one value in every point instead of its flag's sweep (the ``QualitySetup`` field it replaces)
ENGINE_KEYS = ("block_size", "sinks", "recent")
SWEEPS = {
    "policy": "policies",
    "budget": "budgets",
    "granularity": "granularities",
    "score_layers": "score_layers",
    "prompt_tail": "prompt_tails",
    "scope": "scopes",
    "prompt_scores": "prompt_scores",
    "keep_mass": "keep_masses",
    "score_pool": "score_pools",
}


def apply_sets(setup: QualitySetup, sets) -> QualitySetup:
    """``setup`` with ``--set vtoken.KEY=VALUE`` items over its flags (``vtoken.core.config.with_sets`` over
    ``setup.base()``, so values are checked as on construction): ``ENGINE_KEYS`` set the engine's value, a
    point's setting (``SWEEPS``) its one value in every point. ``ConfigError`` names an unknown key (listing the
    valid ones), a bad value or a key a quality run does not carry (mode follows the granularity, seed is
    ``--seed``)."""
    from vtoken.core.config import parse_sets, with_sets
    from vtoken.errors import ConfigError

    over = parse_sets(sets)
    if not over:
        return setup
    carried = (*ENGINE_KEYS, *SWEEPS)
    if other := [k for k in over if k not in carried]:
        raise ConfigError(
            f"--set {', '.join('vtoken.' + k for k in other)}: quality carries only "
            f"{', '.join(carried)} (mode follows --granularities, seed is --seed)"
        )
    cfg = with_sets(setup.base(), sets)
    as_run = cfg.to_dict()  # the budget as its number, enums as their strings: as the flags give them
    return replace(
        setup,
        **{k: as_run[k] for k in ENGINE_KEYS if k in over},
        **{SWEEPS[k]: (as_run[k],) for k in SWEEPS if k in over},
    )


def points(setup: QualitySetup) -> list[Point]:
    return [FULL] + [
        Point(p, g, b, n, t, s, q, m, w)
        for p in setup.policies
        for g in setup.granularities
        for b in setup.budgets
        for n in setup.score_layers
        for t in setup.prompt_tails
        for s in setup.scopes
        for q in setup.prompt_scores
        for m in setup.keep_masses
        for w in setup.score_pools
    ]


def run_retrieval(setup: QualitySetup, tokenizer, pts: list[Point], on_phase) -> dict:
    from vllm import SamplingParams

    cases = passkey_cases(tokenizer, setup.context_tokens, setup.depths, setup.per_depth, setup.seed)
    longest = max(len(c.prompt_ids) for c in cases)
    on_phase(f"retrieval: {len(pts)} points × {len(cases)} prompts of ≈{longest} tokens")

    def params_for(extra, case):
        return SamplingParams(max_tokens=setup.answer_tokens, temperature=0.0, extra_args=extra)

    # one prefill step per prompt, whatever else runs: with chunking, concurrent decodes would split
    # some prompts and the policy would evict between their chunks (not this task's setting)
    max_len = longest + setup.answer_tokens + 8
    results = run_on_engine(
        setup,
        cases,
        pts,
        params_for,
        max_model_len=max_len,
        max_num_batched_tokens=max_len + 256,
        enable_chunked_prefill=False,
    )
    out = {}
    for pt in pts:
        rows = [(c, *results[(pt.key, c.name)]) for c in cases]
        correct = [c.correct(o.outputs[0].text) for c, o, _ in rows]
        by_depth = {
            f"{d:g}": statistics.fmean(ok for (c, _, _), ok in zip(rows, correct) if c.depth == d) for d in setup.depths
        }
        out[pt.key] = {
            "accuracy": round(statistics.fmean(correct), 4),
            "accuracy_by_depth": by_depth,
            "ci95": rate(sum(correct), len(correct))["ci95"],
            **blocks_summary([t for _, _, t in rows]),
        }
    return {
        "cases": [{"name": c.name, "depth": c.depth, "prompt_tokens": len(c.prompt_ids)} for c in cases],
        "points": out,
    }


def run_language_modelling(setup: QualitySetup, tokenizer, pts: list[Point], on_phase) -> dict:
    from vllm import SamplingParams

    windows = text_windows(tokenizer, setup.window_tokens, setup.windows, setup.seed)
    on_phase(f"language modelling: {len(pts)} points × {len(windows)} windows of {setup.window_tokens} tokens")

    def params_for(extra, case):
        return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, extra_args=extra)

    results = run_on_engine(
        setup,
        windows,
        pts,
        params_for,
        max_model_len=setup.window_tokens + 8,
        max_num_batched_tokens=setup.chunk,
        enable_chunked_prefill=True,
    )
    out = {}
    for pt in pts:
        lps, traces = [], []
        for w in windows:
            o, t = results[(pt.key, w.name)]
            lps += [d[tok].logprob for d, tok in zip(o.prompt_logprobs[1:], w.prompt_ids[1:])]
            traces.append(t)
        out[pt.key] = {"perplexity": round(perplexity(lps), 4), "tokens_scored": len(lps), **blocks_summary(traces)}
    return {
        "windows": [{"name": w.name, "offset": w.offset, "tokens": len(w.prompt_ids)} for w in windows],
        "points": out,
    }


def parity_budgets(merged_points: list[dict]) -> list[dict]:
    """Per setting (``SETTING_DEFAULTS``' keys: policy × granularity × score_layers × … × score_pool) × budget
    kind (fraction or token count): the smallest budget at quality parity — inside the full cache's 95 % interval
    on every RULER task (``ruler.at_parity``) and, where fidelity ran, ``keeps_fidelity`` — *with every
    larger budget measured at parity too* (one lucky small budget under a failing larger one is noise, not a
    setting to bank); ``None`` when the largest budget is not at parity. Empty without RULER tasks (the pass
    key's three prompts cannot say). Pure."""
    groups: dict[tuple, list[dict]] = {}
    for p in merged_points:
        if "at_parity" in p.get("ruler", {}):
            kind = "tokens" if isinstance(p["budget"], int) else "fraction"
            key = tuple(p.get(k, default) for k, default in SETTING_DEFAULTS.items())
            groups.setdefault((key, kind), []).append(p)
    out = []
    for (key, kind), group in groups.items():
        best = None
        for p in sorted(group, key=lambda p: p["budget"], reverse=True):
            fidelity = p.get("fidelity")  # None: not measured (a merged yardstick point may lack the half)
            if not (p["ruler"]["at_parity"] and (fidelity is None or fidelity["keeps_fidelity"])):
                break
            best = p["budget"]
        out.append(
            {
                **dict(zip(SETTING_DEFAULTS, key)),
                "budget_kind": kind,
                "budgets": sorted(p["budget"] for p in group),
                "parity_budget": best,
            }
        )
    return out


def run_quality(setup: QualitySetup, on_phase=lambda text: None) -> dict:
    """Both tasks for every point; returns the report (``full_cache``, ``points[]``, per-task details): the
    keys ``REPORT_KEYS``."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(setup.model)
    pts = points(setup)
    retrieval = run_retrieval(setup, tokenizer, pts, on_phase)
    lm = run_language_modelling(setup, tokenizer, pts, on_phase)
    ruler = (
        run_ruler(setup, tokenizer, pts, on_phase) if setup.ruler_tasks else {"tasks": [], "skipped": [], "points": {}}
    )
    fidelity = (
        run_fidelity(setup, tokenizer, pts, on_phase) if setup.fidelity_prompts else {"prompts": [], "points": {}}
    )

    def merged(pt: Point) -> dict:
        r, m = retrieval["points"][pt.key], lm["points"][pt.key]

        def both(key: str) -> float | None:  # the two tasks' means, weighted equally
            values = [x for x in (r[key], m[key]) if x is not None]
            return round(statistics.fmean(values), 3) if values else None

        return {
            "policy": pt.policy,
            "granularity": pt.granularity,
            "mode": pt.mode,
            "budget": pt.budget,
            "score_layers": pt.score_layers,
            "prompt_tail": pt.prompt_tail,
            "scope": pt.scope,
            "prompt_scores": pt.prompt_scores,
            "keep_mass": pt.keep_mass,
            "score_pool": pt.score_pool,
            "accuracy": r["accuracy"],
            "perplexity": m["perplexity"],
            "retained_blocks_mean": both("retained_blocks_mean"),
            "packing_bound_mean": both("packing_bound_mean"),
            "retrieval": r,
            "language_modelling": m,
            "ruler": ruler["points"].get(pt.key, {}),
            "fidelity": fidelity["points"].get(pt.key),
        }

    full = merged(FULL)
    for key in ("budget", *SETTING_DEFAULTS):
        full.pop(key)
    merged_points = [merged(pt) for pt in pts if pt is not FULL]
    return {
        "bench": "quality",
        "command": command_line(),
        "model": setup.model,
        "setup": {k: v for k, v in setup.__dict__.items() if k != "model"},
        "full_cache": full,
        "points": merged_points,
        "parity": parity_budgets(merged_points),
        "retrieval": {"cases": retrieval["cases"]},
        "language_modelling": {"windows": lm["windows"], "chunk": setup.chunk},
        "ruler": {"tasks": ruler["tasks"], "skipped": ruler["skipped"]},
        "fidelity": {k: v for k, v in fidelity.items() if k != "points"},
        "seconds": round(time.perf_counter() - start, 1),
    }
