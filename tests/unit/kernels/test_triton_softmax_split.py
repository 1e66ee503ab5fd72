"""The softmax statistics split over key ranges (``kernels.triton.softmax``) and the per-step launch metadata
(``kernels.triton.plan``), in Triton's interpreter against the torch references (issue 41, item 4).

Small ``split_keys`` make tiny rows span several splits: a request longer than all of them, one shorter than
one split (its later splits see no key and must add nothing to the merge), a prefill chunk whose queries see
different lengths. ``m`` is the max of the same tile logits whatever the split (chunks are whole tiles), so it
must equal the unsplit kernel's bit for bit; ``l`` is the same sum regrouped (within float rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.kernels.gpu_layout import PagedScoreAccumulator, allocate_kv_caches, layout_for, read_k
from vtoken.kernels.scores import RequestScores, row_slots
from vtoken.kernels.triton.plan import NO_ROW, QUERY_FIELDS, kept_queries, query_tables
from vtoken.kernels.triton.scores import _PROBS, TritonScoreAccumulator
from vtoken.kernels.triton.softmax import plan_splits

BS, HKV, HQ, HD = 16, 2, 4, 64
# (name, q_start, q_end, seq_len, block row): 100 keys = 4 splits of 32 at split_keys 32; 7 < one split;
# a 4-query chunk over 70 keys (its queries see 67..70); 33 keys: a second split of one key
SPECS = [
    ("long", 0, 1, 100, [3, 1, 7, 8, 9, 0, 2]),
    ("short", 1, 2, 7, [2]),
    ("chunk", 2, 6, 70, [0, 4, 5, 6, 9]),
    ("edge", 6, 7, 33, [6, 1, 3]),
]


def _setup(dtype=torch.float32, name="flash_attn", layers=2):
    views = allocate_kv_caches(name, layers, 10, BS, HKV, HD, dtype)
    gen = torch.Generator().manual_seed(3)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    query = torch.randn(7, HQ, HD, generator=torch.Generator().manual_seed(4)).to(dtype)
    return views, layout_for(name, views[0]), query


def _accumulate(acc, views, query, windows=None):
    for name, q0, q1, n, row in SPECS:
        acc.requests[name] = RequestScores(
            q0, q1, n, torch.tensor(row), want_attention=True, want_key_norm=False, window=(windows or {}).get(name, 0)
        )
    for layer, view in enumerate(views):
        acc.add_layer(query * (1 + 0.5 * layer), None, view, HD**-0.5)
    return acc


@pytest.mark.parametrize(
    "name,dtype", [("flash_attn", torch.float32), ("cpu", torch.float32), ("LHBNC", torch.bfloat16)]
)
def test_split_scores_equal_the_reference(name, dtype):
    """Several splits, unequal lengths, one request shorter than a split: the statistics equal the torch
    reference (PagedScoreAccumulator) within 1e-4, the unimportance bits exactly."""
    views, layout, query = _setup(dtype, name)
    ref = _accumulate(PagedScoreAccumulator(layout), views, query, {"chunk": 3}).finish()
    acc = _accumulate(TritonScoreAccumulator(layout, block_n=16, split_keys=32), views, query, {"chunk": 3})
    assert (acc._meta["split"].splits, acc._meta["split"].chunk) == (4, 32)
    got = acc.finish()
    for rid in ref:
        for f in ("accumulated", "last", "window"):
            a, b = getattr(got[rid], f), getattr(ref[rid], f)
            assert (a is None) == (b is None), (rid, f)
            if b is not None:
                assert np.max(np.abs(a - b)) <= 1e-4, (rid, f)
        assert np.array_equal(got[rid].unimportant, ref[rid].unimportant), rid


def _stats(views, layout, query, split_keys):
    """(m, l) ``[queries, HQ]`` of the last layer, from a step planned with ``split_keys``."""
    acc = _accumulate(TritonScoreAccumulator(layout, block_n=16, split_keys=split_keys), views, query)
    (state,) = acc._meta["launch"].values()
    return acc._meta, [t.clone() for t in state["out"]]


def _reference_stats(views, layout, query, meta):
    """Torch m and l of every (query, head) of the last layer over its visible keys."""
    m, den = torch.empty(int(meta["tok"].numel()), HQ), torch.empty(int(meta["tok"].numel()), HQ)
    q_last = query.float() * (1 + 0.5 * (len(views) - 1))
    for i, (tok, req, vis) in enumerate(zip(meta["tok"], meta["req"], meta["vis"])):
        _, _, _, n, row = SPECS[int(req)]
        keys = read_k(views[-1], layout, row_slots(torch.tensor(row), n, BS)[: int(vis)]).float()
        s = torch.einsum("hd,khd->hk", q_last[int(tok)], keys.repeat_interleave(HQ // HKV, dim=1)) * HD**-0.5
        m[i] = s.max(dim=1).values
        den[i] = torch.exp(s - m[i][:, None]).sum(dim=1)
    return m, den


def test_merged_stats_equal_one_pass_and_torch():
    """The merge's exactness on its own: m bit-identical to the one-split kernel, l within float rounding;
    both against torch. Fails when the merge drops the rescaling exp(m_s − m) (l off by orders of magnitude)
    or when the stats of a split past a query's keys are not neutral."""
    views, layout, query = _setup()
    meta_one, (m_one, l_one) = _stats(views, layout, query, 4096)
    meta_split, (m_split, l_split) = _stats(views, layout, query, 16)
    assert meta_one["split"].splits == 1 and meta_split["split"].splits == 7
    assert torch.equal(m_split, m_one)
    torch.testing.assert_close(l_split, l_one, rtol=1e-6, atol=0)
    m_ref, l_ref = _reference_stats(views, layout, query, meta_split)
    torch.testing.assert_close(m_split, m_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_split, l_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "longest,block_n,split_keys,max_splits,want",
    [
        (1, 32, 2048, 16, (1, 32)),
        (2048, 32, 2048, 16, (1, 2048)),  # a short context keeps one split (no merge launch)
        (2049, 32, 2048, 16, (2, 1056)),
        (32768, 32, 2048, 16, (16, 2048)),  # batch 1 at 32k: 16 × kv heads programs
        (131072, 32, 2048, 16, (16, 8192)),  # capped: longer chunks
        (100, 16, 32, 16, (4, 32)),
        (40, 32, 1, 64, (2, 32)),  # never more splits than key tiles
    ],
)
def test_split_plan(longest, block_n, split_keys, max_splits, want):
    split = plan_splits(longest, block_n, split_keys, max_splits)
    assert (split.splits, split.chunk) == want
    assert (
        split.chunk % block_n == 0 and (split.splits - 1) * split.chunk < max(longest, 1) <= split.splits * split.chunk
    )


def _tables_by_loop(scored):
    """The per-query loop ``_plan`` had before it was vectorised (the reference)."""
    out, n_rows = {f: [] for f in QUERY_FIELDS}, 0
    for r, rs in enumerate(scored):
        keep = kept_queries(rs)
        where = {qi: n_rows + j for j, qi in enumerate(keep)}
        n_rows += len(keep)
        for qi in range(rs.n_q):
            row = (rs.q_start + qi, r, rs.seq_len - rs.n_q + qi + 1, where.get(qi, NO_ROW), rs.first)
            for f, v in zip(QUERY_FIELDS, row):
                out[f].append(v)
    return np.array([out[f] for f in QUERY_FIELDS], dtype=np.int32), n_rows


def test_vectorised_query_tables_equal_the_per_query_loop():
    row = torch.zeros(8, dtype=torch.int64)
    scored = [
        RequestScores(0, 1, 50, row, True, False, first=10),
        RequestScores(1, 91, 120, row, True, False, window=80, first=3),  # 90 queries: last 64 + window
        RequestScores(91, 92, 7, row, True, False),
        RequestScores(92, 97, 60, row, True, False, window=5),
    ]
    tables, kept, n_rows = query_tables(scored)
    want, want_rows = _tables_by_loop(scored)
    assert np.array_equal(tables, want) and n_rows == want_rows == sum(len(k) for k in kept)


def test_metadata_is_built_once_per_step_and_aligned(monkeypatch):
    """Every layer's launches get the same tables, index table and m/l buffers (one ``launch_state`` per
    step and query kind); each query table starts 16-byte aligned (``triton.jit`` specialises pointers on
    16-byte divisibility: a misaligned one would compile another variant)."""
    views, layout, query = _setup(layers=3)
    seen = []
    real = _PROBS.launch
    monkeypatch.setattr(_PROBS, "launch", lambda device, grid, *a, **k: (seen.append(a), real(device, grid, *a, **k)))
    acc = _accumulate(TritonScoreAccumulator(layout, block_n=16, split_keys=32), views, query)
    assert len(seen) == 3 and len(acc._meta["launch"]) == 1
    tensors = [[id(x) for x in args if isinstance(x, torch.Tensor)][2:] for args in seen]  # after query, cache
    assert tensors[0] == tensors[1] == tensors[2]
    assert all(acc._meta[f].data_ptr() % 16 == 0 for f in QUERY_FIELDS)
