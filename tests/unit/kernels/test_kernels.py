"""vtoken.kernels on vLLM's real CPU KV cache: layout probe, slot moves (K and V read back slot by slot),
score collection. No engine: the cache is written with vLLM's own ``cpu_attn_reshape_and_cache``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops  # noqa: E402 (no importorskip: a broken vLLM must fail, not skip)

from vtoken.kernels.layout import TokenLayout, probe_layout, split_kv_cache
from vtoken.kernels.moves import TorchSlotMover, read_kv
from vtoken.kernels.scores import RequestScores, ScoreAccumulator, attention_probs


def _writer(isa: str = "vec"):
    def write(k, v, kc, vc, sm):
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, sm, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    return write


def _filled_cache(num_blocks, nkv, bs, hd, slots, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, nkv, bs, 2 * hd, dtype=dtype)
    k = torch.randn(len(slots), nkv, hd, generator=g).to(dtype)
    v = torch.randn(len(slots), nkv, hd, generator=g).to(dtype)
    kc, vc = split_kv_cache(cache)
    _writer()(k, v, kc, vc, torch.as_tensor(slots, dtype=torch.int64))
    return cache, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,hd", [(32, 32), (64, 64)])
def test_probe_finds_the_documented_vec_layout(dtype, bs, hd):
    """The probe (backend's own writer) agrees with the layout documented for the vec ISA: K transposed."""
    layout = probe_layout(_writer(), bs, 2, hd, dtype)
    assert torch.equal(layout.index, TokenLayout.cpu_vec(bs, hd).index)
    # K really is transposed: channel 1 of token 0 sits one block_size further, not one element further.
    assert int(layout.index[0, 1] - layout.index[0, 0]) == bs


def test_read_kv_returns_what_the_backend_wrote():
    bs, hd, nkv = 32, 32, 2
    slots = [0, 5, 31, 32, 70]
    cache, k, v = _filled_cache(4, nkv, bs, hd, slots)
    layout = probe_layout(_writer(), bs, nkv, hd, torch.float32)
    rk, rv = read_kv(cache, layout, torch.tensor(slots))
    assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("bs", [32, 64])
def test_moves_copy_k_and_v_slot_by_slot(bs):
    """After a repack, every destination slot holds its source token's K and V exactly (read back through
    the documented layout, independently of the mover's probed one); nothing else changed."""
    hd, nkv, nb = 32, 2, 6
    n = 3 * bs + 7
    cache, k, v = _filled_cache(nb, nkv, bs, hd, list(range(n)), seed=1)
    vec = TokenLayout.cpu_vec(bs, hd)
    before_k, before_v = read_kv(cache, vec, torch.arange(nb * bs))
    # holes below live are filled from the tail, tail sources in descending order (TokenTable.plan)
    rng = np.random.default_rng(0)
    holes = np.sort(rng.choice(np.arange(4, 2 * bs), size=bs // 2, replace=False))
    live = n - holes.size
    tail = np.setdiff1d(np.arange(live, n), [])[::-1][: holes.size]
    src, dst = torch.from_numpy(tail.copy()), torch.from_numpy(holes)
    other = cache.clone()
    TorchSlotMover(probe_layout(_writer(), bs, nkv, hd, torch.float32)).move([cache, other], src, dst)
    after_k, after_v = read_kv(cache, vec, torch.arange(nb * bs))
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(after_k[d], before_k[s]) and torch.equal(after_v[d], before_v[s])
    untouched = np.setdiff1d(np.arange(nb * bs), holes)
    assert torch.equal(after_k[untouched], before_k[untouched])
    assert torch.equal(after_v[untouched], before_v[untouched])
    assert torch.equal(other, cache)  # every layer tensor is moved


def test_moved_cache_feeds_vllm_attention_kernel_exactly():
    """Attention over the repacked (dense) row equals attention over the kept tokens of the original."""
    bs, hd, nkv, heads = 32, 32, 2, 4
    n = 80
    cache, k, v = _filled_cache(4, nkv, bs, hd, list(range(n)), seed=2)
    holes = np.array([5, 6, 7, 20, 33, 40])
    keep = np.setdiff1d(np.arange(n), holes)
    live = keep.size
    tail = np.flatnonzero(np.isin(np.arange(live, n), keep)) + live
    layout = probe_layout(_writer(), bs, nkv, hd, torch.float32)
    TorchSlotMover(layout).move([cache], torch.from_numpy(tail[::-1].copy()), torch.from_numpy(holes[holes < live]))
    q = torch.randn(1, heads, hd, generator=torch.Generator().manual_seed(3))
    out = torch.zeros(1, heads, hd)
    kc, vc = split_kv_cache(cache)
    seq_lens = torch.tensor([live], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    block_table = torch.arange(4, dtype=torch.int32)[None]
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=heads,
        num_kv_heads=nkv,
        head_dim=hd,
        seq_lens=seq_lens,
        dtype=torch.float32,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa="vec",
        enable_kv_split=False,
        dynamic_causal=None,
        kv_cache_dtype="auto",
    )
    ops.cpu_attention_with_kv_cache(
        query=q,
        key_cache=kc,
        value_cache=vc,
        output=out,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=hd**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
        dynamic_causal=None,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    kk = k[keep].repeat_interleave(heads // nkv, dim=1)  # [live, H, D]
    vv = v[keep].repeat_interleave(heads // nkv, dim=1)
    p = torch.softmax(torch.einsum("hd,khd->hk", q[0], kk) * hd**-0.5, dim=-1)
    ref = torch.einsum("hk,khd->hd", p, vv)
    assert torch.allclose(out[0], ref, atol=1e-5)


def test_attention_probs_gqa_and_causal():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(5, 2, 8, generator=g)
    p = attention_probs(q, k, 0.5)
    assert p.shape == (3, 5)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    assert torch.all(p[0, 3:] == 0) and torch.all(p[1, 4:] == 0) and torch.all(p[2] > 0)
    # reference: per head, then mean
    ref = torch.stack(
        [
            torch.softmax((q[:, h] @ k[:, h // 2].T) * 0.5 + torch.triu(torch.full((3, 5), -1e30), 3), -1)
            for h in range(4)
        ]
    ).mean(0)
    assert torch.allclose(p, ref, atol=1e-6)


def test_score_accumulator_reads_the_row_through_the_block_table():
    bs, hd, nkv = 32, 32, 1
    cache, k, _ = _filled_cache(4, nkv, bs, hd, list(range(96, 128)) + list(range(32, 64)), seed=5)
    layout = probe_layout(_writer(), bs, nkv, hd, torch.float32)
    acc = ScoreAccumulator(layout)
    acc.requests["r"] = RequestScores(
        q_start=0, q_end=1, seq_len=40, block_row=torch.tensor([3, 1]), want_attention=True, want_key_norm=True
    )
    q = torch.randn(1, 2, hd)
    key = torch.randn(1, nkv, hd)
    acc.add_layer(q, key, cache, 0.1)
    acc.add_layer(q, key, cache, 0.1)
    out = acc.finish()["r"]
    keys = torch.cat([k[:32], k[32:40]])  # row slots 0..39 = block 3 then block 1
    ref = attention_probs(q, keys, 0.1)[0].double().numpy()
    assert np.allclose(out.accumulated, ref, atol=1e-6) and np.allclose(out.last, ref, atol=1e-6)
    assert out.unimportant.dtype == np.uint64 and out.n_queries == 1
    assert np.allclose(out.key_norm, key.norm(dim=-1).mean().item(), atol=1e-6)


def test_score_accumulator_decode_batch_equals_one_by_one():
    """Several decode requests scored as one padded batch give the same scores as one at a time; a prefill
    chunk in the same step is scored on its own."""
    bs, hd, nkv, heads = 32, 32, 2, 4
    cache, _, _ = _filled_cache(8, nkv, bs, hd, list(range(8 * bs)), seed=6)
    layout = probe_layout(_writer(), bs, nkv, hd, torch.float32)
    g = torch.Generator().manual_seed(7)
    specs = [("a", 0, 1, 40, [0, 1]), ("b", 1, 2, 7, [2]), ("c", 2, 5, 70, [3, 4, 5]), ("d", 5, 6, 64, [6, 7])]
    q = torch.randn(6, heads, hd, generator=g)

    def run(names):
        acc = ScoreAccumulator(layout)
        for name, q0, q1, n, row in specs:
            if name in names:
                acc.requests[name] = RequestScores(
                    q0, q1, n, torch.tensor(row), want_attention=True, want_key_norm=False
                )
        acc.add_layer(q, None, cache, 0.2)
        acc.add_layer(q * 0.5, None, cache, 0.2)
        return acc.finish()

    together = run({"a", "b", "c", "d"})
    assert together["a"].n_queries == 1 and together["c"].n_queries == 3
    for name in "abcd":
        alone = run({name})[name]
        for f in ("accumulated", "last", "unimportant"):
            assert np.allclose(getattr(together[name], f), getattr(alone, f), atol=1e-6), (name, f)
