"""Score only what can be evicted (issue 41, item 2): ``vtoken.core.scored_range`` picks the first row slot a
step scores, and both accumulators (torch and Triton, interpreted) then keep, transfer and fold only
``[first, seq_len)`` — equal, slot for slot, to the full-range statistics there (the softmax still sees every
key; the unimportance threshold stays 1/visible keys) — and the Triton one drops the per-query rows when a
request has one query.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.core.config import VTokenConfig
from vtoken.core.scored_range import first_scored, protected_prefix
from vtoken.core.step_stats import SlotScores
from vtoken.kernels.backend_check import Shape, make_accumulator, scheduler_plan, setup
from vtoken.kernels.scores import RequestScores


@pytest.mark.parametrize(
    "settings,prompt_len,want",
    [
        ({}, 100, 100),  # scope generated (default): the whole prompt
        ({"sinks": 120}, 100, 120),
        ({"scope": "all"}, 100, 4),  # the sinks only
        ({"scope": "all", "prompt_tail": 10}, 100, 4),  # a kept tail past the start is no prefix
        ({"scope": "all", "prompt_tail": 200}, 100, 100),  # a tail covering the prompt is
        ({"score_pool": 3}, 100, 97),  # span pooling reads 3 neighbours back
        ({"policy": "tova"}, 100, 100),
        ({"policy": "scissorhands"}, 100, 100),
        ({"policy": "rkv"}, 100, 0),  # redundancy: a softmax over every live token
        ({"policy": "snapkv"}, 100, 0),  # window: ranks add the maximum over every live token
        ({"trigger": "pressure"}, 100, 0),  # the batch-wide order divides by the mass of every live token
    ],
)
def test_first_scored_is_the_protected_prefix(settings, prompt_len, want):
    cfg = VTokenConfig(**settings)
    assert first_scored(cfg, prompt_len) == want
    assert first_scored(cfg, prompt_len, full=True) == 0  # scores: always
    assert protected_prefix(cfg, prompt_len) >= want


def _run(backend: str, firsts: list[int], seed: int = 3) -> tuple[dict[str, SlotScores], object]:
    """One step over a random multi-request plan: request 0 a 6-query chunk ending the prompt (window 4),
    the others one decode query each; ``firsts[i]`` is request i's first scored slot."""
    shape = Shape(layers=2, blocks=64, block_size=16, kv_heads=2, q_heads=4, head_dim=32, dtype=torch.float32)
    caches, layout = setup("cpu" if backend == "cpu" else "LBNHC", shape, "cpu", seed)
    plan = scheduler_plan(np.random.default_rng(seed), len(firsts), shape.blocks, shape.block_size)
    acc = make_accumulator(backend, "cpu" if backend == "cpu" else "LBNHC", layout)
    start = 0
    for i, (row, live) in enumerate(zip(plan.rows, plan.live)):
        n_q = 6 if i == 0 else 1
        acc.requests[f"r{i}"] = RequestScores(
            start,
            start + n_q,
            int(live),
            torch.from_numpy(row.astype(np.int64)),
            want_attention=True,
            want_key_norm=False,
            window=4 if i == 0 else 0,
            first=firsts[i],
        )
        start += n_q
    query = torch.randn(start, shape.q_heads, shape.head_dim, generator=torch.Generator().manual_seed(seed))
    for layer, kv in enumerate(caches):
        acc.add_layer(query * (1.0 + 0.1 * layer), None, kv, shape.head_dim**-0.5)
    return acc.finish(), acc


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_accumulators_score_exactly_the_range(backend):
    full, _ = _run(backend, [0, 0, 0, 0])
    lens = [full[f"r{i}"].seq_len for i in range(4)]
    firsts = [lens[0] // 3, 5, lens[2] - 1, 0]
    part, acc = _run(backend, firsts)
    for i, first in enumerate(firsts):
        got, ref = part[f"r{i}"], full[f"r{i}"]
        assert got.first == first and got.seq_len == ref.seq_len
        for name in ("accumulated", "last", "window"):
            a, b = getattr(got, name), getattr(ref, name)
            if b is None:
                assert a is None
                continue
            assert a.shape == (ref.seq_len - first,), name
            np.testing.assert_allclose(a, b[first:], rtol=1e-6, atol=1e-9, err_msg=name)
        np.testing.assert_array_equal(got.unimportant, ref.unimportant[first:])
        table = np.arange(ref.seq_len)[::-1].copy()  # any slot→token map
        by = got.by_logical(table, 0)
        assert np.array_equal(by.logicals, table[first:]) and by.first == first
    if backend == "triton":  # the kernels' buffers: the longest scored range, rows for the chunk's queries only
        meta = acc._meta
        assert meta["kmax"] == max(n - f for n, f in zip(lens, firsts))
        assert meta["n_rows"] == 6 and [len(k) for k in meta["kept"]] == [6, 0, 0, 0]


def test_triton_decode_only_step_has_no_rows_to_reduce_or_copy():
    _, acc = _run("triton", [0, 0, 0], seed=5)
    acc.requests.pop("r0")  # (the chunk was planned already: rebuild a decode-only accumulator)
    scored = [rs for rs in acc.requests.values()]
    meta = acc._plan(scored, torch.device("cpu"))
    assert meta["n_rows"] == 0 and meta["rows"].numel() == 1
    acc._meta = meta
    attention, _ = acc.linear_buffers()
    assert len(attention) == 1 and attention[0] is meta["sums"]
