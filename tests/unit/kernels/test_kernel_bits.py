"""``compare_unimportance_bits`` (vtoken/kernels/backend_check.py): the one comparison of the unimportance bits that
``vtoken bench kernels``, ``scripts/gpu_check.py`` and tests/gpu use. A kernel summing bf16 products in fp32
in another order than torch may put a probability that lies within ~1e-7 of the threshold 1/visible on the
other side: such a flip is counted as a near-tie and accepted; any flip away from the threshold fails.
Hand-made probabilities, so each case states which bit of which row flips.
"""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.core.step_stats import unimportance_bits
from vtoken.kernels.backend_check import NEAR_TIE_RTOL, BitsComparison, compare_unimportance_bits

TIE = 0.25  # 4 visible keys
# row 0 (older query: bit 1), row 1 (newest: bit 0); key 0 is a near-tie in row 0, key 1 in row 1
PROBS = np.array([[TIE * (1 - 1e-6), 0.10, 0.40, 0.25], [0.10, TIE * (1 + 1e-5), 0.40, 0.25]])
VISIBLE = np.ones_like(PROBS, dtype=bool)


def _flip(bits: np.ndarray, key: int, bit: int) -> np.ndarray:
    out = bits.copy()
    out[key] ^= np.uint64(1) << np.uint64(bit)
    return out


def test_equal_bits_have_no_mismatch():
    ref = unimportance_bits(PROBS, VISIBLE)
    assert compare_unimportance_bits(ref, ref, PROBS, VISIBLE) == BitsComparison(0, 0)


@pytest.mark.parametrize("key,bit", [(0, 1), (1, 0)])
def test_a_flip_at_a_near_tie_passes_and_is_counted(key, bit):
    ref = unimportance_bits(PROBS, VISIBLE)
    got = compare_unimportance_bits(_flip(ref, key, bit), ref, PROBS, VISIBLE)
    assert got == BitsComparison(mismatched=1, near_threshold=1) and got.ok


@pytest.mark.parametrize("key,bit", [(0, 0), (1, 1), (2, 1), (3, 0)])
def test_a_flip_away_from_the_threshold_fails(key, bit):
    """(0, 0) and (1, 1): the key is a near-tie in the *other* row only (the bit → row mapping matters);
    (2, 1): 0.4 in row 0; (3, 0): 0.30 in the newest row."""
    probs = PROBS.copy()
    probs[1, 3] = 0.30
    ref = unimportance_bits(probs, VISIBLE)
    got = compare_unimportance_bits(_flip(ref, key, bit), ref, probs, VISIBLE)
    assert got.mismatched == 1 and got.near_threshold == 0 and not got.ok


def test_near_and_far_flips_together_fail_and_both_are_counted():
    ref = unimportance_bits(PROBS, VISIBLE)
    got = compare_unimportance_bits(_flip(_flip(ref, 0, 1), 2, 0), ref, PROBS, VISIBLE)
    assert got == BitsComparison(mismatched=2, near_threshold=1) and not got.ok


def test_the_tolerance_is_relative_to_each_rows_threshold():
    """Causal rows: the older query sees 3 keys (threshold 1/3), the newest 4 (1/4). A probability just
    outside NEAR_TIE_RTOL of its own row's threshold is far; a key the row cannot see is never a tie."""
    visible = np.array([[True, True, True, False], [True, True, True, True]])
    probs = np.array(
        [[(1 / 3) * (1 + 0.5 * NEAR_TIE_RTOL), (1 / 3) * (1 - 2 * NEAR_TIE_RTOL), 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]]
    )
    ref = unimportance_bits(probs, visible)
    assert compare_unimportance_bits(_flip(ref, 0, 1), ref, probs, visible).ok
    assert not compare_unimportance_bits(_flip(ref, 1, 1), ref, probs, visible).ok
    assert not compare_unimportance_bits(_flip(ref, 3, 1), ref, probs, visible).ok  # invisible key


def test_only_the_last_64_rows_carry_bits():
    """70 queries: bit 63 is row 6; a near-tie in row 5 (no bit) does not excuse anything, and a bit above
    the rows' count (fewer than 64 rows) is always an error."""
    n = 70
    probs = np.full((n, 4), 0.1)
    probs[:, 2] = 0.7
    probs[6, 0] = TIE * (1 + 1e-6)
    probs[5, 1] = TIE * (1 + 1e-6)
    visible = np.ones_like(probs, dtype=bool)
    ref = unimportance_bits(probs, visible)
    assert compare_unimportance_bits(_flip(ref, 0, 63), ref, probs, visible).ok
    assert not compare_unimportance_bits(_flip(ref, 1, 63), ref, probs, visible).ok
    short = unimportance_bits(PROBS, VISIBLE)
    got = compare_unimportance_bits(_flip(short, 2, 5), short, PROBS, VISIBLE)
    assert got == BitsComparison(1, 0)
