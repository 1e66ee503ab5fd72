"""``TritonKernel`` (vtoken/kernels/triton/runtime.py): what ``triton.jit`` sees of the wrapped kernels.

The compiled variant is built from a copy of the kernel function with other globals; ``triton.jit`` reads
the ``tl.constexpr`` annotations from that copy to decide which arguments are compile-time constants. A
copy without them made every constexpr a runtime argument: a compiled launch then fails to bind (a str
PRECISION cannot be specialised) or cannot compile (``tl.arange`` of a runtime bound). The sm_90 compile
tests (test_triton_compile.py) pass their own signature and so did not see it.
"""

from __future__ import annotations

import inspect

import pytest
import triton.language as tl

from vtoken.kernels.triton.attention import _DECODE
from vtoken.kernels.triton.knorm import _KNORM
from vtoken.kernels.triton.moves import _COPY
from vtoken.kernels.triton.runtime import TritonKernel
from vtoken.kernels.triton.scores import _PROBS
from vtoken.kernels.triton.softmax import _MERGE, _STATS


@pytest.mark.parametrize("kernel", [_COPY, _STATS, _MERGE, _PROBS, _DECODE, _KNORM], ids=lambda k: k.fn.__name__)
@pytest.mark.parametrize("interpret", [False, True])
def test_both_variants_see_the_constexpr_annotations(kernel, interpret):
    annotated = {name for name, ann in kernel.fn.__annotations__.items() if "constexpr" in str(ann)}
    assert annotated  # every kernel has some
    fn = kernel._variant(interpret)
    if interpret:  # the interpreter reads the annotations of its copy when it launches
        seen = {name for name, ann in inspect.get_annotations(fn.fn).items() if "constexpr" in str(ann)}
    else:
        seen = {p.name for p in fn.params if p.is_constexpr}
    assert seen == annotated


def _axpy(x_ptr, y_ptr, a, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, a * tl.load(x_ptr + i, mask=i < n) + tl.load(y_ptr + i, mask=i < n), mask=i < n)


def test_do_not_specialize_reaches_triton_jit_and_names_are_checked():
    kernel = TritonKernel(_axpy, do_not_specialize=("n",))
    assert [p.name for p in kernel.compiled().params if p.do_not_specialize] == ["n"]
    with pytest.raises(ValueError, match="names no argument"):
        TritonKernel(_axpy, do_not_specialize=("m",))


def test_the_interpreted_variant_interprets_wherever_it_is_first_asked_for():
    from triton.runtime.interpreter import InterpretedFunction

    kernel = TritonKernel(_axpy)
    assert isinstance(kernel._variant(True), InterpretedFunction)
    assert not isinstance(kernel.compiled(), InterpretedFunction)


def _count_tiles(n_ptr, out_ptr, BLOCK: tl.constexpr):
    n = tl.load(n_ptr)
    tiles = n * 0
    for _start in range(0, n, BLOCK):  # a loaded loop bound, as the score kernels' range(0, vis, BLOCK_N)
        tiles += 1
    tl.store(out_ptr, tiles)


def test_a_loaded_loop_bound_runs_in_the_interpreter_where_numpy_refuses_int_of_a_1_element_array():
    """Triton 3.6's interpreter took ``range``'s bound with ``int()`` of the ``[1]``-shaped array holding a
    scalar, which NumPy 2.4 refuses (TypeError) and NumPy < 2.4 warns about (DeprecationWarning, made an
    error here to stand for 2.4): gpu_check --dry-run failed so under triton 3.6 + numpy 2.4.6.
    ``interpreting()`` squeezes first (what triton 3.9 does itself)."""
    import warnings

    import torch
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    out = torch.zeros(1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        TritonKernel(_count_tiles).launch(
            torch.device("cpu"), (1,), torch.tensor([40], dtype=torch.int32), out, BLOCK=16
        )
    assert out.item() == 3
    assert interpreter._patch_lang_tensor is patch  # restored after the launch
