"""``vtoken bench codegen``: the rule's task half — HumanEval completions per point against the full cache.

Side effects: starts one in-process vLLM engine (``vtoken.vllm.offline.launch.start_engine``) with a KV pool of
``kv_space_gib`` (a preempted request would be recomputed from its prompt, a different eviction history:
``run_codegen`` raises), writes traces to a temporary directory it removes, and runs every completion's
program in a child Python (``code.passes``). Greedy decoding: each point's completion of a problem is
compared with the full cache's completion of the same problem (paired per instance).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass

from vtoken.bench.quality.longgen import code, rule
from vtoken.core.config import VTokenConfig

FULL_LABEL = "full"  # the paired reference: budget 1.0, nothing evicted
REPORT_KEYS = frozenset({"bench", "command", "model", "setup", "rule", "source", "full_cache", "points", "seconds"})
POINT_KEYS = frozenset(
    {
        "label",
        "settings",
        "accuracy",
        "difference",
        "lower95",
        "task_ok",
        "changed",
        "evicted_tokens",
        "retained_blocks_mean",
        "generated_tokens_mean",
        "per_problem",
    }
)


@dataclass(frozen=True)
class CodegenSetup:
    """One run: ``points`` are ``(label, VTokenConfig)``, each run on the first ``problems`` problems."""

    model: str
    points: tuple[tuple[str, VTokenConfig], ...]
    problems: int = 164
    max_tokens: int = 384
    seed: int = 0
    block_size: int = 32
    max_num_seqs: int = 64
    kv_space_gib: int = 6


def run_engine(setup: CodegenSetup, probs: list[code.Problem], trace_dir: str) -> dict:
    """``{label: [(completion text, generated tokens, evicted tokens, mean held blocks), …]}`` over ``probs``
    for the full cache and every point, all as requests of one engine."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vtoken.bench.quality.longgen.run import generate, request_settings, unpreempted_trace

    tok = AutoTokenizer.from_pretrained(setup.model)
    encoded = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in probs]
    runs = ((FULL_LABEL, VTokenConfig(budget=1.0)), *setup.points)
    prompts, params, keys = [], [], []
    for label, cfg in runs:
        for i, (p, ids) in enumerate(zip(probs, encoded)):
            tid = f"{label}__{p.task_id.replace('/', '-')}"
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(
                    max_tokens=setup.max_tokens,
                    temperature=0.0,
                    stop=list(code.STOP),
                    extra_args={"vtoken": request_settings(cfg, tid, 1000 + i)},
                )
            )
            keys.append((label, tid))
    longest = max(len(ids) for ids in encoded) + setup.max_tokens
    outs = generate(setup, prompts, params, trace_dir, longest + setup.block_size)
    result: dict[str, list] = {label: [] for label, _ in runs}
    for (label, tid), out in zip(keys, outs):
        trace = unpreempted_trace(trace_dir, tid)
        held = statistics.fmean(trace.held_blocks) if trace.held_blocks else 0.0
        o = out.outputs[0]
        result[label].append((o.text, len(o.token_ids), trace.evicted, held))
    return result


def run_codegen(setup: CodegenSetup, on_phase=lambda text: None) -> dict:
    """Generate, then judge every completion: ``{label: {"passed": [bool…], "text": […], …}}``."""
    probs = code.problems()[: setup.problems]
    on_phase(f"engine: {len(setup.points) + 1} runs × {len(probs)} problems")
    with tempfile.TemporaryDirectory(prefix="vtoken-codegen-") as tmp:
        generated = run_engine(setup, probs, tmp)
    on_phase("running the unit tests")
    judged = {}
    for label, rows in generated.items():
        judged[label] = {
            "passed": [code.passes(p, text) for p, (text, *_) in zip(probs, rows)],
            "text": [text for text, *_ in rows],
            "tokens": [n for _, n, _, _ in rows],
            "evicted": [e for _, _, e, _ in rows],
            "held": [h for *_, h in rows],
        }
    if any(judged[FULL_LABEL]["evicted"]):
        raise RuntimeError("the full-cache reference evicted tokens")
    return judged


def build_report(setup: CodegenSetup, judged: dict, command: str, seconds: float) -> dict:
    """The JSON report: per point the paired accuracy difference against the full cache, its one-sided 95 %
    lower bound and the rule's task verdict, with the per-problem results it came from. Pure."""
    full = judged[FULL_LABEL]
    points = []
    for label, cfg in setup.points:
        got = judged[label]
        diff = rule.paired_difference(got["passed"], full["passed"])
        points.append(
            {
                "label": label,
                "settings": cfg.to_dict(),
                "accuracy": round(statistics.fmean(got["passed"]), 4),
                **diff,
                "task_ok": diff["lower95"] >= rule.TASK_DIFF_BOUND,
                "changed": sum(a != b for a, b in zip(got["text"], full["text"])),
                "evicted_tokens": sum(got["evicted"]),
                "retained_blocks_mean": round(statistics.fmean(got["held"]), 3),
                "generated_tokens_mean": round(statistics.fmean(got["tokens"]), 2),
                "per_problem": got["passed"],
            }
        )
    return {
        "bench": "codegen",
        "command": command,
        "model": setup.model,
        "setup": {
            "problems": setup.problems,
            "max_tokens": setup.max_tokens,
            "seed": setup.seed,
            "block_size": setup.block_size,
            "max_num_seqs": setup.max_num_seqs,
            "stop": list(code.STOP),
        },
        "rule": {
            "task_diff_bound": rule.TASK_DIFF_BOUND,
            "bootstrap_resamples": rule.BOOTSTRAP_RESAMPLES,
            "bootstrap_seed": rule.BOOTSTRAP_SEED,
        },
        "source": {"name": code.SOURCE, "sha256": code.digest()},
        "full_cache": {
            "accuracy": round(statistics.fmean(full["passed"]), 4),
            "per_problem": full["passed"],
            "retained_blocks_mean": round(statistics.fmean(full["held"]), 3),
            "generated_tokens_mean": round(statistics.fmean(full["tokens"]), 2),
        },
        "points": points,
        "seconds": round(seconds, 1),
    }
