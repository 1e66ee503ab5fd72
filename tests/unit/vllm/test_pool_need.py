"""``vtoken/vllm/scheduling/pool_need.py``: vLLM 0.32's KV cache groups and the smallest pool it starts an engine on,
from the model's config alone (pure; the engine itself is the oracle in test_vllm_hybrid.py)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from vtoken.vllm.scheduling.pool_need import FULL, PoolShape, group_windows, pool_shape

S, F = "sliding_attention", "full_attention"


def test_groups_follow_vllms_pattern_rule():
    """Gemma 3 270M (15 sliding : 3 global) -> 5 sliding groups + 1 full; the tiny Gemma 3 (3 : 1) -> 3 + 1;
    gpt-oss-like 12 sliding : 13 global pads to one group of each (no kind has 1.5 x the fewest)."""
    assert sorted(group_windows(([512] * 5 + [FULL]) * 3), key=str) == [512] * 5 + [FULL]
    assert sorted(group_windows([64, 64, 64, FULL]), key=str) == [64] * 3 + [FULL]
    assert sorted(group_windows([128] * 12 + [FULL] * 13), key=str) == [128, FULL]
    assert group_windows([FULL] * 30) == (FULL,)


def test_need_counts_every_group_and_the_null_block():
    """The tiny Gemma 3 at max_model_len 1024 with 2048 tokens in flight: a full group of 32 blocks and three
    sliding groups of min(63 + 2048, 1024) / 32 + 1 = 33 — 132 with the null block (vLLM starts at 132,
    refuses 131: measured 2026-12-03)."""
    shape = PoolShape(windows=(64, 64, 64, FULL), block_size=32, in_flight_tokens=2048)
    assert shape.need(1024) == 32 + 3 * 33 + 1 == 132
    assert shape.describe(1024) == ("3 sliding-window (64) groups x 33 + 1 full-attention group x 32 + the null block")
    small = PoolShape(windows=(64, 64, 64, FULL), block_size=32, in_flight_tokens=64)
    assert small.need(448) == 14 + 3 * (4 + 1) + 1 == 30  # a window's blocks stop growing with the length
    assert PoolShape(windows=(FULL,), block_size=32, in_flight_tokens=0).need(1024) == 33


@given(
    windows=st.lists(st.one_of(st.none(), st.integers(1, 600)), min_size=1, max_size=6),
    block=st.sampled_from([16, 32, 64]),
    in_flight=st.integers(1, 4096),
    pool=st.integers(1, 400),
)
def test_longest_len_is_the_largest_length_the_pool_holds(windows, block, in_flight, pool):
    shape = PoolShape(windows=tuple(windows), block_size=block, in_flight_tokens=in_flight)
    longest = shape.longest_len(pool)
    cap = pool * block  # reached only by a model whose every group is sliding (any length fits)
    assert shape.need(longest + 1) > pool or (longest == cap and FULL not in windows)
    assert longest == 0 or shape.need(longest) <= pool
    assert shape.need(longest) <= shape.need(longest + 1)  # monotone where the search relies on it


def _config(layer_types=None, window=None, disabled=False):
    text = SimpleNamespace(sliding_window=window, **({"layer_types": layer_types} if layer_types else {}))
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text),
        cache_config=SimpleNamespace(block_size=32),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disabled),
        max_in_flight_tokens=2048,
    )


def test_shape_reads_layer_types_and_falls_back_to_one_full_group():
    assert sorted(pool_shape(_config([S, S, S, F], 64)).windows, key=str) == [64, 64, 64, FULL]
    assert pool_shape(_config([S, F], 64)).in_flight_tokens == 2048
    assert pool_shape(_config([F, F])).windows == (FULL,)  # a plain model
    assert pool_shape(_config(window=4096)).windows == (FULL,)  # no layer_types: at least what vLLM needs
    assert pool_shape(_config([S, F], 64, disabled=True)).windows == (FULL,)  # hybrid manager off: one group
    assert pool_shape(_config([S, S], 64)).windows == (64,)  # every layer sliding: one sliding group
