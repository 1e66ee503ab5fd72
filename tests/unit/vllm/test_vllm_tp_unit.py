"""Tensor-parallel score reduction (vtoken/vllm/runner/tp.py) without processes: each rank's accumulators are built
from its head shard as vLLM shards them, the all-reduce is a fake that sums what every rank passed, and the
reduced statistics must equal the TP = 1 statistics of the whole model (no KV head counted twice)."""

from __future__ import annotations

import pytest
import torch

from vtoken.kernels.scores import attention_probs
from vtoken.vllm.runner.tp import HeadShards, reduce_buffers


@pytest.mark.parametrize(
    "tp,q,kv,replicas,kv_local", [(2, 4, 2, 1, 1), (2, 6, 1, 2, 1), (4, 8, 2, 2, 1), (2, 8, 8, 1, 4), (1, 4, 2, 1, 2)]
)
def test_head_shards(tp, q, kv, replicas, kv_local):
    s = HeadShards(tp=tp, q_heads=q, kv_heads=kv)
    assert (s.replicas, s.kv_local) == (replicas, kv_local)
    assert s.q_weight * tp == pytest.approx(1.0)
    # a rank's value is a mean over its kv_local heads; each head sits on `replicas` ranks: its total weight
    # kv_weight · replicas / kv_local must be 1 / kv (a mean over the distinct heads)
    assert s.kv_weight * s.replicas / s.kv_local == pytest.approx(1 / kv)


def test_head_shards_refuse_uneven_splits():
    with pytest.raises(ValueError):
        HeadShards(tp=2, q_heads=3, kv_heads=1)
    with pytest.raises(ValueError):
        HeadShards(tp=4, q_heads=8, kv_heads=3)


def _shard(heads: int, tp: int, rank: int) -> slice:
    """vLLM's split: contiguous head ranges; a replicated KV head (tp > heads) goes to rank·heads // tp."""
    if tp <= heads:
        n = heads // tp
        return slice(rank * n, (rank + 1) * n)
    h = rank * heads // tp
    return slice(h, h + 1)


@pytest.mark.parametrize("tp,q_heads,kv_heads", [(2, 4, 2), (2, 6, 1), (4, 8, 2), (4, 8, 1)])
def test_reduced_scores_equal_the_whole_model(tp, q_heads, kv_heads):
    """Attention (mean over all query heads of softmax(q·Kᵀ)) and key norms (mean over distinct KV heads):
    Σ_ranks of the weighted per-rank values == the TP = 1 values, for GQA and replicated (MQA) KV heads."""
    g = torch.Generator().manual_seed(0)
    n_q, n_k, d = 3, 7, 8
    q = torch.randn(n_q, q_heads, d, generator=g)
    k = torch.randn(n_k, kv_heads, d, generator=g)
    new_keys = torch.randn(n_q, kv_heads, d, generator=g)
    whole_probs = attention_probs(q, k, 0.3)
    whole_norm = new_keys.norm(dim=-1).mean(dim=-1)

    shards = HeadShards(tp=tp, q_heads=q_heads, kv_heads=kv_heads)
    ranks = []
    for r in range(tp):
        qs, ks = _shard(q_heads, tp, r), _shard(kv_heads, tp, r)
        ranks.append(([attention_probs(q[:, qs], k[:, ks], 0.3)], [new_keys[:, ks].norm(dim=-1).mean(dim=-1)]))
    passed: list[torch.Tensor] = []

    def fake_all_reduce(t):
        passed.append(t.clone())
        return t  # replaced below once every rank has contributed

    for att, norms in ranks:  # each rank flattens and weights its own buffers (same order, same shapes)
        reduce_buffers([a.clone() for a in att], [n.clone() for n in norms], shards, fake_all_reduce)
    total = torch.stack(passed).sum(dim=0)
    att, norms = ranks[0]
    reduce_buffers(att, norms, shards, lambda t: total)
    torch.testing.assert_close(att[0], whole_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms[0], whole_norm, rtol=1e-5, atol=1e-6)


def test_reduce_buffers_is_one_call_and_skips_empty_steps():
    calls = []
    reduce_buffers([], [], HeadShards(2, 4, 2), lambda t: calls.append(t) or t)
    assert calls == []
    a, b = torch.ones(2, 3), torch.ones(4)
    reduce_buffers([a], [b], HeadShards(2, 4, 2), lambda t: calls.append(t) or t * 2)
    assert len(calls) == 1 and calls[0].numel() == 10
    torch.testing.assert_close(a, torch.ones(2, 3))  # weight 1/2, summed over 2 "ranks"
    torch.testing.assert_close(b, torch.ones(4))


class _NoFinish:
    """A step's accumulator whose statistics must not be read back or finished."""

    @property
    def requests(self) -> dict:
        return {}

    def linear_buffers(self):
        return [], []

    def finish(self):
        raise AssertionError("finished on a rank whose output vLLM drops")


@pytest.mark.parametrize("output", [False, True])
def test_only_the_output_rank_finishes_the_step_statistics(output):
    """After the all-reduce every rank joins, a non-output TP rank (vLLM replies from TP rank 0) drops the
    step's statistics: no read-back, no ``finish``; the output rank finishes them."""
    from vtoken.vllm.runner.mixin import VTokenRunnerMixin
    from vtoken.vllm.runner.tp import HeadShards, TPReducer
    from vtoken.vllm.transport import StepResult

    class Group:
        def all_reduce(self, t):
            return t

    runner = VTokenRunnerMixin()
    runner._vt_tp = TPReducer(Group(), HeadShards(tp=2, q_heads=4, kv_heads=2), output=output)
    runner._vt_result, runner._vt_acc = StepResult(step=3), _NoFinish()
    out = object()
    if output:
        with pytest.raises(AssertionError, match="finished"):
            runner._vt_attach(out)
    else:
        assert runner._vt_attach(out) is out and runner._vt_acc is None
