"""Triton kernels compiled for the H200 (sm_90) without a GPU, and the stride products of their IR (used by
tests/unit/kernels/test_triton_compile.py and test_triton_knorm.py)."""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, asm: str = "ptx") -> str:
    """PTX (or ``asm="ttir"``: Triton's IR) of the compiled variant for sm_90."""
    fn = kernel.compiled()
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    assert set(signature) == set(types) | set(constexprs), set(signature) ^ (set(types) | set(constexprs))
    divisible = [n for n, t in types.items() if t.startswith("*") or n.endswith(("stride", "_st", "_sh"))]
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible if n not in kernel.do_not_specialize
    }
    src = ASTSource(
        fn=fn, signature=signature, attrs=attrs, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm[asm]


# ---------------------------------------------------------------- 64-bit element offsets (issue 24)
STRIDES = ("block_stride", "head_stride", "token_stride", "q_st", "q_sh", "o_st", "o_sh", "bt_stride", "kmax")
_PASS_THROUGH = {"tt.splat", "tt.broadcast", "tt.expand_dims", "arith.extsi", "tt.reshape"}
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*?)(?: loc\(.*)?$")


def stride_products(ttir: str) -> list[tuple[str, str, str]]:
    """``(stride argument, muli line's result type, line)`` for every ``arith.muli`` in ``ttir`` that
    multiplies by a stride argument (followed through splat/broadcast/expand_dims/extsi)."""
    origin = {f"%{name}": name for name in STRIDES if re.search(rf"%{name}: i\d+", ttir)}
    found = []
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        value, op, rest = m.groups()
        args = [a for a in re.findall(r"%[\w.]+", rest) if a in origin]
        if op in _PASS_THROUGH and args:
            origin[value] = origin[args[0]]
        elif op == "arith.muli" and args:
            found.extend((origin[a], rest.rsplit(" : ", 1)[1], line.strip()) for a in args)
    return found
