#!/usr/bin/env python3
"""The prepared device check for vToken's Triton kernels on one H200 (docs/gpu.md).

Needs only torch, triton, numpy and this repository's files (no vLLM, no network, nothing installed: the
repository root goes on ``sys.path``). Writes one JSON report (``--out``, also printed) in under 5 minutes:

  warmup             (first, cold) TritonSlotMover.warmup and TritonScoreAccumulator.warmup on the Llama-3-8B
                     flash_attn cache: their seconds, every cache byte unchanged, and no kernel compiled by
                     the steps after them (moves direct and staged, two score steps of other query counts)
  correctness        Llama-3-8B shapes (32 layers, 8 kv heads, 32 query heads, head_dim 128, B = 16, bf16):
                     TritonSlotMover vs the torch reference (every K and V element) and TritonScoreAccumulator
                     vs the torch reference (max |Δ|; unimportance bits: a flip only at a near-tie, counted)
                     for several vLLM 0.32 KV layouts, and the paged decode attention (the yardstick below)
                     vs torch
  large_offsets      (CUDA only) an LHBNC cache at H200 scale, Llama-3.2-1B heads (8 kv heads, head_dim 64),
                     2 layers of 196,608 blocks: 3.2e9 elements per layer view, 12.9 GB; moves and scores on
                     the highest blocks and heads, where offsets pass 2^31, vs the torch reference
  bandwidth          one move launch (all layers) vs a plain torch copy of the same bytes (the device's copy
                     bandwidth) vs the torch reference mover
  scores_vs_attention  the two score kernels for one layer vs a paged decode attention of the same shape
  graph_loop         a synthetic decode step (paged decode attention over every layer) captured in
                     CUDA graphs, replayed alone, with the step's moves, with moves + score kernels:
                     the overhead ratios

The random inputs are drawn with seeded ``torch.Generator``s on the device the check runs on: every cache's
contents (``vtoken.kernels.backend_check.fill_random`` draws on the caches' device), the decode sections' queries and
block tables. The full check fills ~28e9 cache elements,
which the host's generator took 110–240 s of the 270 s budget to draw. Left on the host: the repack plans
(numpy, a few thousand draws) and ``check_scores``' query (a few hundred thousand). Kernels and references
run on the same caches, so which values are drawn does not change what is checked.

``--dry-run`` runs every section on the CPU with tiny shapes, the Triton kernels in Triton's interpreter and
no CUDA graphs (eager steps instead): it proves the imports, the code paths and the report format, not speed.
Exit status 0 when every correctness check passed, 1 otherwise, 2 on a bad invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from vtoken.kernels.backend_check import (  # noqa: E402
    Shape,
    check_moves,
    check_scores,
    fill_random,
    large_offsets_check,
    run_scores,
    scheduler_plan,
    score_specs,
    setup,
    timed,
    token_bytes,
)
from vtoken.kernels.gpu_layout import PagedTorchMover, allocate_kv_caches, layout_for  # noqa: E402
from vtoken.kernels.scores import RequestScores  # noqa: E402
from vtoken.kernels.triton import moves as triton_moves  # noqa: E402
from vtoken.kernels.triton import scores as triton_scores  # noqa: E402
from vtoken.kernels.triton.attention import paged_decode, paged_decode_reference  # noqa: E402
from vtoken.kernels.triton.moves import TritonSlotMover  # noqa: E402
from vtoken.kernels.triton.scores import TritonScoreAccumulator  # noqa: E402

FORBIDDEN = ("vllm", "typer", "rich", "ray", "transformers", "pydantic")
SCORE_TOL = 1e-4
BUDGET_S = 270.0

FULL = dict(
    shape=Shape(32, 8, 32, 128, 16, 1024, torch.bfloat16),
    requests=32,
    layouts=("flash_attn", "LBHNC", "LHBNC", "BLHNC", "BHLNC"),
    bw_blocks=4096,
    bw_moves=4096,
    decode_requests=32,
    decode_blocks=64,
    step_moves=64,
    repeats=20,
    large=Shape(2, 8, 32, 64, 16, 196608, torch.bfloat16),
)
DRY = dict(
    shape=Shape(2, 2, 4, 64, 16, 12, torch.float32),
    requests=3,
    layouts=("cpu", "LHBNC", "BLHNC"),
    bw_blocks=12,
    bw_moves=8,
    decode_requests=2,
    decode_blocks=2,
    step_moves=4,
    repeats=1,
    large=None,
)


def device_generator(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def warmup(cfg: dict, device: str) -> dict:
    """The runner's start-up warm-ups, then a step's moves and two score steps: no new compiled variant
    (CUDA; the interpreter compiles nothing, so the dry run checks only that no cache byte changed)."""
    shape = cfg["shape"]
    caches, lay = setup("flash_attn", shape, device, 6)
    before = [kv.clone() for kv in caches]
    kernels = {**triton_moves.KERNELS, **triton_scores.KERNELS}
    dev = torch.device(device)
    count = (lambda: {n: k.compiled_variants(dev) for n, k in kernels.items()}) if device == "cuda" else dict
    t0 = time.perf_counter()
    mover = TritonSlotMover(lay)  # the runner's capacity (512)
    mover.warmup(caches)
    TritonScoreAccumulator.warmup(lay, caches[0], shape.q_heads, shape.head_dim, shape.dtype, shape.head_dim**-0.5)
    if device == "cuda":
        torch.cuda.synchronize()
    report = {
        "warmup_s": time.perf_counter() - t0,
        "caches_unchanged": all(torch.equal(a, b) for a, b in zip(caches, before)),
    }
    variants = count()
    rng = np.random.default_rng(6)
    plan = scheduler_plan(rng, cfg["requests"], shape.blocks, shape.block_size)
    src, dst = plan.src[: mover.capacity], plan.dst[: mover.capacity]
    mover.move(caches, src, dst)  # host plan: direct
    mover.move(caches, src.to(device), dst.to(device))  # device plan: staged
    qgen = device_generator(device, 6)
    for max_queries in (3, 8):  # two steps of different query counts
        specs = score_specs(plan, rng, max_queries)
        query = torch.randn(
            specs[-1][1], shape.q_heads, shape.head_dim, generator=qgen, device=device, dtype=shape.dtype
        )
        run_scores(TritonScoreAccumulator(lay), caches, specs, query, shape.head_dim**-0.5)
    after = count()
    report["variants_after_warmup"] = variants
    report["compiled_by_steps"] = {n: after[n] - variants[n] for n in variants}
    report["ok"] = report["caches_unchanged"] and not any(report["compiled_by_steps"].values())
    return report


def checks_pass(row: dict) -> bool:
    """A layout's moves (direct, staged) exact, scores within ``SCORE_TOL``, bits equal but at near-ties."""
    return bool(
        row["moves_exact"]
        and row["staged_moves_exact"]
        and row["scores_max_abs_err"] <= SCORE_TOL
        and row["scores_bits_ok"]
    )


def correctness(cfg: dict, device: str) -> dict:
    """Moves and scores vs the torch reference per layout, and the paged attention vs torch."""
    shape, out = cfg["shape"], {}
    for name in cfg["layouts"]:
        plan = scheduler_plan(np.random.default_rng(0), cfg["requests"], shape.blocks, shape.block_size)
        capacity = max(16, int(plan.src.numel()))
        row = check_moves("triton", name, shape, device, plan, 0, capacity)  # host plan: direct launch
        staged = check_moves("triton", name, shape, device, plan, 0, capacity, plan_on_device=True)
        row["staged_moves_exact"] = staged["moves_exact"]
        row.update(check_scores("triton", name, shape, device, plan, 1))
        row["ranges_overlap"] = plan.ranges_overlap
        row["ok"] = checks_pass(row)
        out[name] = row
    caches, lay, q, table, lens, scale = decode_setup(cfg, device, "flash_attn")
    got = torch.empty_like(q)
    paged_decode(q, caches[0], lay, table, lens, scale, got)
    err = float((got.float() - paged_decode_reference(q, caches[0], lay, table, lens, scale)).abs().max())
    tol = 1e-4 if shape.dtype == torch.float32 else 2e-2  # the output is rounded to the cache dtype
    out["paged_attention"] = {"max_abs_err": err, "ok": err <= tol}
    return out


def large_offsets(cfg: dict, device: str) -> dict:
    """Moves and scores where element offsets exceed 2^31 (``large_offsets_check``); CUDA only."""
    if cfg["large"] is None:
        return {"skipped": "needs CUDA (tests/integration/test_triton_large_offsets.py runs it in the interpreter)"}
    row = large_offsets_check("LHBNC", cfg["large"], device)
    torch.cuda.empty_cache()  # give the 12.9 GB back to the sections after this one
    row["offsets_exceed_2^31"] = row["max_element_offset"] >= 2**31
    row["ok"] = row["offsets_exceed_2^31"] and checks_pass(row)
    return row


def bandwidth(cfg: dict, device: str) -> dict:
    """One fixed-capacity move launch over every layer vs a torch copy of the same bytes."""
    shape = dataclasses.replace(cfg["shape"], blocks=cfg["bw_blocks"])
    caches, lay = setup("flash_attn", shape, device, 2)
    plan = scheduler_plan(np.random.default_rng(2), max(1, shape.blocks // 64), shape.blocks, shape.block_size)
    n = min(cfg["bw_moves"], int(plan.src.numel()))
    src, dst = plan.src[:n].to(device), plan.dst[:n].to(device)
    mover = TritonSlotMover(lay, capacity=n)
    mover.prepare(caches, staged=True)
    mover.set_plan(src, dst)
    moved = 2 * n * shape.layers * token_bytes(shape)  # each moved token read once and written once
    direct_ms = timed(lambda: mover.launch(staged=False), device, cfg["repeats"])
    staged_ms = timed(lambda: mover.launch(staged=True), device, cfg["repeats"])
    host_src, host_dst = src.cpu(), dst.cpu()  # what the worker passes: move() checks disjointness, copies
    move_ms = timed(lambda: mover.move(caches, host_src, host_dst), device, cfg["repeats"])
    a = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), device, cfg["repeats"])
    ref_ms = timed(lambda: PagedTorchMover(lay).move(caches, src, dst), device, cfg["repeats"])
    copy_gbs = moved / copy_ms / 1e6
    return {
        "moves": n,
        "layers": shape.layers,
        "bytes_read_plus_written": moved,
        "direct_launch_ms": direct_ms,
        "direct_gb_s": moved / direct_ms / 1e6,
        "staged_launch_ms": staged_ms,
        "staged_gb_s": moved / staged_ms / 1e6,
        "move_ms_from_host_plan": move_ms,
        "copy_ms": copy_ms,
        "copy_gb_s": copy_gbs,
        "direct_vs_copy": moved / direct_ms / 1e6 / copy_gbs,
        "staged_vs_copy": moved / staged_ms / 1e6 / copy_gbs,
        "torch_reference_ms": ref_ms,
    }


def decode_setup(cfg: dict, device: str, name: str):
    """Caches of ``decode_requests`` rows of ``decode_blocks`` full blocks each, one decode query each."""
    base = cfg["shape"]
    blocks = cfg["decode_requests"] * cfg["decode_blocks"]
    caches = allocate_kv_caches(
        name, base.layers, blocks, base.block_size, base.kv_heads, base.head_dim, base.dtype, device
    )
    fill_random(caches, 3)
    perm = torch.randperm(blocks, generator=device_generator(device, 3), device=device)
    table = perm.view(cfg["decode_requests"], cfg["decode_blocks"]).to(torch.int32)
    lens = torch.full(
        (cfg["decode_requests"],), cfg["decode_blocks"] * base.block_size, dtype=torch.int32, device=device
    )
    q = torch.randn(
        cfg["decode_requests"],
        base.q_heads,
        base.head_dim,
        generator=device_generator(device, 4),
        device=device,
        dtype=base.dtype,
    )
    return caches, layout_for(name, caches[0]).to(device), q, table, lens, base.head_dim**-0.5


def decode_accumulator(lay, table, lens, device) -> TritonScoreAccumulator:
    acc = TritonScoreAccumulator(lay)
    for r in range(table.shape[0]):
        acc.requests[f"r{r}"] = RequestScores(
            r, r + 1, int(lens[r]), table[r].to(torch.int64), want_attention=True, want_key_norm=False
        )
    return acc


def scores_vs_attention(cfg: dict, device: str) -> dict:
    caches, lay, q, table, lens, scale = decode_setup(cfg, device, "flash_attn")
    out = torch.empty_like(q)
    acc = decode_accumulator(lay, table, lens, device)
    acc.add_layer(q, None, caches[0], scale)  # builds the step's metadata once
    score_ms = timed(lambda: acc._launch(q, caches[0], scale, acc._meta), device, cfg["repeats"])
    attn_ms = timed(lambda: paged_decode(q, caches[0], lay, table, lens, scale, out), device, cfg["repeats"])
    return {
        "requests": int(q.shape[0]),
        "seq_len": int(lens[0]),
        "score_kernels_ms_per_layer": score_ms,
        "paged_attention_ms_per_layer": attn_ms,
        "score_vs_attention": score_ms / attn_ms,
    }


def graph_loop(cfg: dict, device: str) -> dict:
    """Decode steps over every layer: alone, with a fixed-capacity move launch, with moves + scores."""
    caches, lay, q, table, lens, scale = decode_setup(cfg, device, "flash_attn")
    out = torch.empty_like(q)
    n = cfg["step_moves"]
    slots = torch.randperm(int(lens.sum()), generator=device_generator(device, 5), device=device)[: 2 * n]
    rows = table.view(-1).long()
    phys = rows[slots // lay.block_size] * lay.block_size + slots % lay.block_size
    mover = TritonSlotMover(lay, capacity=n)
    mover.prepare(caches)
    mover.set_plan(phys[:n], phys[n:])
    acc = decode_accumulator(lay, table, lens, device)
    acc.add_layer(q, None, caches[0], scale)

    def attend():
        for kv in caches:
            paged_decode(q, kv, lay, table, lens, scale, out)

    def with_moves():
        mover.launch()
        attend()

    def with_scores():
        mover.launch()
        for kv in caches:
            paged_decode(q, kv, lay, table, lens, scale, out)
            acc._launch(q, kv, scale, acc._meta)

    steps = {"plain": attend, "repack": with_moves, "repack_scores": with_scores}
    report: dict = {"requests": int(q.shape[0]), "seq_len": int(lens[0]), "layers": len(caches), "moves": n}
    for key, fn in steps.items():
        report[f"eager_ms_{key}"] = timed(fn, device, cfg["repeats"])
    if device != "cuda":
        report["cuda_graphs"] = "skipped: needs CUDA (dry run: eager steps only)"
        return report
    for key, fn in steps.items():
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            fn()
        report[f"graph_ms_{key}"] = timed(graph.replay, device, cfg["repeats"])
    report["overhead_repack"] = report["graph_ms_repack"] / report["graph_ms_plain"]
    report["overhead_repack_scores"] = report["graph_ms_repack_scores"] / report["graph_ms_plain"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON report goes")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device (run with --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    device, cfg = ("cpu", DRY) if args.dry_run else ("cuda", FULL)
    start = time.perf_counter()
    report: dict = {
        "check": "vtoken gpu_check",
        "dry_run": args.dry_run,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "capability": list(torch.cuda.get_device_capability(0)) if device == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {k: str(v) for k, v in vars(cfg["shape"]).items()},
        "random_inputs_drawn_on": device,
        "forbidden_modules_loaded": sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN),
    }
    sections = {
        "warmup": warmup,
        "correctness": correctness,
        "large_offsets": large_offsets,
        "bandwidth": bandwidth,
        "scores_vs_attention": scores_vs_attention,
        "graph_loop": graph_loop,
    }
    for name, fn in sections.items():
        if time.perf_counter() - start > BUDGET_S:
            report[name] = {"skipped": f"time budget ({BUDGET_S:.0f} s) spent"}
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn(cfg, device)
        except Exception as err:  # one failing section must not lose the others' numbers
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        report[name]["seconds"] = round(time.perf_counter() - t0, 2)
    checks, large = report["correctness"], report["large_offsets"]
    report["ok"] = (
        "error" not in checks
        and "skipped" not in checks
        and all(row["ok"] for key, row in checks.items() if isinstance(row, dict))
        and (large.get("ok", False) if device == "cuda" else "error" not in large)
        and report["warmup"].get("ok", False)
        and not report["forbidden_modules_loaded"]
    )
    report["seconds"] = round(time.perf_counter() - start, 2)
    text = json.dumps(report, indent=2, default=str)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
