"""Trace SLO-aware admission step by step, in-process: the served engine's settings without the serving stack.

A diagnostic, not a benchmark: it builds the engine a ``vtoken bench serve`` replica would (``engine_args``
of that variant's ``ServeAppConfig``, from ``variant_config``, admission on) in this process, feeds it Poisson
arrivals of random prompts
itself (no HTTP, no Ray), and records after every step what the scheduler saw — so the admission limit's
course can be read next to the step-time fit and the prefill overhead it was computed from, which the
served ``timeline`` of ``vtoken bench serve`` does not carry.

    python scripts/admission_trace.py --mode repack --policy h2o --pool-blocks 24 --rate 0.5 --out trace.json

Writes one JSON object: ``command``, ``summary`` (SLO attainment, duration, lowest limit after the first
20 steps, largest TTFT and TPOT) and ``steps``: ``[seconds, step_s, running, waiting, limit, fit (a, b) or
null, overhead O, overhead batch n̄, decode samples]`` per step; ``requests``: ``[ttft_s, tpot_s]`` each.
Side effects: loads the model, sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the scheduler must be in this
process), seeds Python's ``random`` with ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--mode", default="repack")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", default="0.2")
    p.add_argument("--pool-blocks", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.35, help="Poisson arrivals (req/s)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--ttft-ms", type=float, default=15000.0)
    p.add_argument("--tpot-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for name in ("pool_blocks", "num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.rate > 0:
        p.error(f"--rate must be > 0, got {args.rate}")
    return args


def main(argv: list[str]) -> dict:
    args = parse(argv)
    from vtoken.bench.served.bench import variant_config
    from vtoken.bench.served.plan import ServeBenchSetup

    try:  # a bad mode, policy, budget or a pool too small for the requests, before vLLM is imported
        setup = ServeBenchSetup(
            model=args.model,
            budget=args.budget,
            pool_blocks=args.pool_blocks,
            input_len=args.input_len,
            output_len=args.output_len,
            ttft_ms=args.ttft_ms,
            tpot_ms=args.tpot_ms,
        )
        cfg = variant_config(setup, args.mode, None if args.mode == "none" else args.policy, admission=True)
    except ValueError as err:  # pydantic's ValidationError is one; exit 2 as argparse does
        print(f"admission_trace.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from vtoken.serve.replica.engine import engine_args, resolve_model_path

    llm = LLM(**engine_args(cfg, resolve_model_path(args.model)))
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.num_prompts):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    vocab = engine.model_config.get_vocab_size()
    prompts = [[rng.randrange(vocab // 8, vocab) for _ in range(args.input_len)] for _ in arrivals]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    steps, first, done, tokens, added = [], {}, {}, {}, 0
    t0 = time.monotonic()
    while len(done) < len(arrivals):
        now = time.monotonic() - t0
        while added < len(arrivals) and arrivals[added] <= now:
            engine.add_request(str(added), {"prompt_token_ids": prompts[added]}, params)
            added += 1
        if not engine.has_unfinished_requests():  # idle until the next arrival (no busy loop)
            time.sleep(min(0.05, max(0.0, arrivals[added] - now)))
            continue
        began = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic() - t0
        for o in outputs:
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = ended
            if o.finished:
                done[o.request_id], tokens[o.request_id] = ended, len(o.outputs[0].token_ids)
        model = sched._vt_steptime
        fit = model.fit()
        steps.append(
            [
                round(ended, 3),
                round(time.monotonic() - began, 4),
                len(sched.running),
                len(sched.waiting),
                sched.max_num_active_reqs,
                None if fit is None else [round(fit[0], 5), round(fit[1], 5)],
                round(model.overhead, 5),
                round(model.overhead_batch, 3),
                model.samples,
            ]
        )
    requests = [
        [round(first[k] - arrivals[int(k)], 3), round((done[k] - first[k]) / max(1, tokens[k] - 1), 4)]
        for k in sorted(done, key=int)
    ]
    met = sum(ttft <= args.ttft_ms / 1000 and tpot <= args.tpot_ms / 1000 for ttft, tpot in requests)
    report = {
        "command": "python " + shlex.join(sys.argv),
        "summary": {
            "slo_attainment": met / len(requests),
            "duration_s": steps[-1][0],
            "limit_min_after_20_steps": min((s[4] for s in steps[20:]), default=None),
            "ttft_max_s": max(r[0] for r in requests),
            "tpot_max_s": max(r[1] for r in requests),
        },
        "steps": steps,
        "requests": requests,
    }
    with open(args.out, "w") as f:
        json.dump(report, f)
    print(json.dumps(report["summary"]))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
