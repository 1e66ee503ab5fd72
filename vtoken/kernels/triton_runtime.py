"""Launch a Triton kernel for the device its tensors are on: CUDA → compiled, CPU → Triton's interpreter.

How Triton picks (triton 3.6-3.9, ``triton/runtime/jit.py: jit``): ``triton.jit`` returns an interpreted
function when ``triton.knobs.runtime.interpret`` (the ``TRITON_INTERPRET`` variable, read when asked) is on at
*decoration* time. ``triton.language``'s own ``@jit`` helpers (``tl.sum``, ``tl.max``, ``tl.zeros``, …) are
decorated when ``triton`` is imported, so a process must set ``TRITON_INTERPRET=1`` before that import for
them to be interpretable; the variable is process-wide and would also switch vLLM's Triton kernels.

``TritonKernel`` needs neither: it keeps the plain kernel function and wraps it on first use, once normally
(CUDA) and once inside ``knobs.runtime.scope()`` with ``interpret = True`` (CPU), and launches the interpreted
one inside the same scope. Each variant gets its own copy of the module's globals in which the helper
functions it calls are wrapped the same way (an interpreted kernel cannot call a compiled helper, nor the
reverse). The kernels avoid ``tl.sum``/``tl.max``/``tl.zeros`` and use builtins and ``tl.reduce`` with
Triton's combine functions (what ``tl.sum``/``tl.max`` do; the interpreter maps them to numpy). Nothing else
in the process changes; with ``TRITON_INTERPRET=1`` set anyway, both variants interpret.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import triton
from triton import knobs


@contextmanager
def interpreting():
    """Triton's interpreter on for the ``with`` body only (restores the knobs after)."""
    with knobs.runtime.scope():
        knobs.runtime.interpret = True
        yield


def _with_globals(fn: Callable, namespace: dict) -> Callable:
    """``fn`` with another globals dict (same code, so Triton still finds its source)."""
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


class TritonKernel:
    """A kernel function (plain, undecorated) and the plain helper functions it calls, launched with
    ``kernel.launch(device, grid, *args, **constexprs)``."""

    def __init__(self, fn: Callable, helpers: Sequence[Callable] = ()) -> None:
        self.fn = fn
        self.helpers = tuple(helpers)
        self._variants: dict[bool, object] = {}

    def _variant(self, interpret: bool):
        if interpret not in self._variants:
            namespace = dict(self.fn.__globals__)
            for helper in self.helpers:
                namespace[helper.__name__] = triton.jit(_with_globals(helper, namespace))
            self._variants[interpret] = triton.jit(_with_globals(self.fn, namespace))
        return self._variants[interpret]

    def compiled(self):
        """The compiled-mode ``JITFunction`` (for ``triton.compile`` checks without a GPU)."""
        return self._variant(False)

    def launch(self, device: torch.device, grid: tuple[int, ...], *args, **kwargs) -> None:
        """Run the kernel over ``grid`` (mutates the output tensors among ``args``)."""
        if device.type == "cpu":
            with interpreting():
                self._variant(True)[grid](*args, **kwargs)
            return
        self._variant(False)[grid](*args, **kwargs)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
