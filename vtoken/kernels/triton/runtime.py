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
from contextlib import contextmanager, nullcontext

import torch
import triton
from triton import knobs


@contextmanager
def interpreting():
    """Triton's interpreter on for the ``with`` body only (restores the knobs after), with a scalar's
    ``__index__`` that NumPy 2.4 accepts (``_scalar_index``)."""
    with knobs.runtime.scope(), _scalar_index():
        knobs.runtime.interpret = True
        yield


@contextmanager
def _scalar_index():
    """For the ``with`` body: the interpreter's ``tensor.__index__`` (what Python's ``range`` calls on a
    loaded loop bound, e.g. ``range(0, vis, BLOCK_N)`` in the score kernels) squeezes the ``[1]``-shaped array
    that holds a scalar before ``int()``. Triton 3.6's interpreter calls ``int()`` on the array itself, which
    NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
    triton-lang/triton#9171; 3.9 squeezes, #9172). Wraps ``interpreter._patch_lang_tensor`` (called at
    every interpreted launch, triton 3.6-3.9), whose scope restores the attribute after the launch; does
    nothing where Triton has no such function. Interpreter only: compiled kernels never call ``__index__``."""
    try:
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):
        yield
        return

    def patch(tensor, scope, *rest, **kwargs):
        original(tensor, scope, *rest, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


def _with_globals(fn: Callable, namespace: dict) -> Callable:
    """``fn`` with another globals dict (same code, so Triton still finds its source) and the same
    annotations: ``triton.jit`` reads ``tl.constexpr`` from them (``types.FunctionType`` does not copy them;
    without them every constexpr would be a runtime argument, which a compiled launch cannot bind)."""
    out = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__annotations__ = dict(fn.__annotations__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__doc__ = fn.__doc__
    return out


class TritonKernel:
    """A kernel function (plain, undecorated) and the plain helper functions it calls, launched with
    ``kernel.launch(device, grid, *args, **constexprs)``.

    ``do_not_specialize``: names of integer arguments that ``triton.jit`` must not specialise (by default
    it compiles one variant per combination of "== 1" and "divisible by 16" of every integer argument, and
    turns a 1 into a constant): the ones whose value changes from step to step (query counts, row lengths,
    block-table widths), so that the compiled variants are a fixed set that a warm-up can compile once.
    Passed to ``triton.jit`` for both variants (triton 3.6-3.9 spell it ``do_not_specialize``).
    """

    def __init__(self, fn: Callable, helpers: Sequence[Callable] = (), do_not_specialize: Sequence[str] = ()) -> None:
        self.fn = fn
        self.helpers = tuple(helpers)
        self.do_not_specialize = tuple(do_not_specialize)
        unknown = set(self.do_not_specialize) - set(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        if unknown:
            raise ValueError(f"{fn.__name__}: do_not_specialize names no argument: {sorted(unknown)}")
        self._variants: dict[bool, object] = {}

    def _variant(self, interpret: bool):
        """The ``triton.jit`` function for Triton's interpreter (``interpret``) or for compiling, built on first
        use (the interpreted one inside ``interpreting()``, wherever it is asked for)."""
        if interpret not in self._variants:
            with interpreting() if interpret else nullcontext():
                namespace = dict(self.fn.__globals__)
                for helper in self.helpers:
                    namespace[helper.__name__] = triton.jit(_with_globals(helper, namespace))
                self._variants[interpret] = triton.jit(
                    _with_globals(self.fn, namespace), do_not_specialize=list(self.do_not_specialize)
                )
        return self._variants[interpret]

    def compiled(self):
        """The compiled-mode ``JITFunction`` (for ``triton.compile`` checks without a GPU)."""
        return self._variant(False)

    def compiled_variants(self, device: torch.device) -> int:
        """How many variants ``triton.jit`` has compiled of this kernel for CUDA ``device`` in this process
        (0 before the first launch there; reads Triton's per-device cache, triton 3.6-3.9). Pure."""
        fn = self._variants.get(False)
        caches = getattr(fn, "device_caches", {}) if fn is not None else {}
        index = device.index if device.index is not None else torch.cuda.current_device()
        return len(caches[index][0]) if index in caches else 0

    def launch(self, device: torch.device, grid: tuple[int, ...], *args, **kwargs) -> None:
        """Run the kernel over ``grid`` (mutates the output tensors among ``args``)."""
        if device.type == "cpu":
            with interpreting():
                self._variant(True)[grid](*args, **kwargs)
            return
        self._variant(False)[grid](*args, **kwargs)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
