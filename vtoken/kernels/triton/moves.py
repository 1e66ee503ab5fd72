"""``TritonSlotMover``: a step's KV slot moves, every layer, in fixed-shape Triton launches.

The torch movers (``TorchSlotMover``, ``PagedTorchMover``) are the reference; this one gives the same
bytes. A plan is ``(src[i], dst[i])`` physical slots. Exact for *any* plan (a destination may be another
pair's source): *every* source element of *every* layer is read into a staging buffer before *any*
destination is written, the boundary between two launches being the global barrier (the programs of one
launch run in no defined order)::

    host: src/dst → persistent int64 buffers of ``capacity`` entries, padded with NO_SLOT (-1)
    launch 1 (gather)   grid (capacity, layers): program (i, l) copies token src[i] of layer l, every kv
                        head and K+V channel, into stage[l, i]          (-1: nothing; reads only)
          ── kernel boundary: all reads of launch 1 happen before any write of launch 2 ──
    launch 2 (scatter)  grid (capacity, layers): program (i, l) writes stage[l, i] onto token dst[i]
                        of layer l                                      (-1: nothing)

    e.g. moves (9→2) (2→5): launch 1 reads 9 and 2, launch 2 writes 2 and 5 → slot 5 gets the old slot 2,
    which a pair-by-pair copy would have overwritten first.

The scheduler's plans have disjoint sources and destinations (docs/architecture.md §3); when ``move`` can see
that on the host (CPU plan tensors, as the worker passes them) it runs one *direct* launch instead, program
(i, l) copying src[i] → dst[i] of layer l, which is exact because no program writes what another reads, and
moves half the bytes of the staged pair.

Layers are addressed from the first layer's tensor by per-layer element offsets (``data_ptr`` differences:
vLLM's layer views share one allocation; separate tensors work too, same address space), so one launch
covers all layers of any ``PagedLayout`` (CPU ISA packing through the index table, CUDA layouts by
arithmetic). The grid depends only on ``capacity`` and the layer count, never on the plan: ``set_plan``
(host→device copy) then ``launch`` can be captured in a CUDA graph once and replayed. Plans longer than
``capacity`` run in chunks, exact only for disjoint sources and destinations (checked; ``ValueError``).

Compiled variants (CUDA): ``_token_copy`` has no argument that changes from step to step (the plan lives in
the persistent slot buffers, the grid is fixed), so a mover compiles exactly three variants, MODE = DIRECT,
GATHER, SCATTER, each specialised on its layout (strides, block size, heads, width, ALIGN) and capacity.
``warmup`` launches all three once at start-up with an all-padding plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton.language as tl

from vtoken.kernels.gpu_layout import PagedLayout, check_view
from vtoken.kernels.moves import unique_caches
from vtoken.kernels.triton.runtime import TritonKernel, next_pow2

GATHER, SCATTER, DIRECT = 0, 1, 2
NO_SLOT = -1  # a padded plan entry: the program does nothing


def _token_at(
    layer_off_ptr, index_ptr, layer, slot, block_stride, token_stride, BLOCK_SIZE, WIDTH, WIDTH_P2, STRIDED, ALIGN
):
    """``[1, WIDTH_P2]`` element offsets (kv head 0) of token ``slot`` of ``layer`` from the first layer,
    int64 (a layer's view can exceed 2^31 elements: vLLM's LHBNC on an H200-sized cache)."""
    slot = slot.to(tl.int64)
    block = slot // BLOCK_SIZE
    off = slot - block * BLOCK_SIZE
    c = tl.arange(0, WIDTH_P2)[None, :]
    base = tl.load(layer_off_ptr + layer) + block * block_stride
    if STRIDED:
        return tl.multiple_of(base + off * token_stride, ALIGN) + c
    return base + tl.load(index_ptr + off * WIDTH + c, mask=c < WIDTH, other=0)


def _token_copy(
    cache_ptr,
    layer_off_ptr,
    src_ptr,
    dst_ptr,
    stage_ptr,
    index_ptr,
    block_stride,
    head_stride,
    token_stride,
    CAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_TILE: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    STRIDED: tl.constexpr,
    ALIGN: tl.constexpr,
    MODE: tl.constexpr,
):
    """Program (i, l), MODE GATHER: token src[i] of layer l → stage[l, i]; SCATTER: stage[l, i] → token
    dst[i]; DIRECT: token src[i] → token dst[i]. A padded entry (NO_SLOT, -1) does nothing. ALIGN divides
    every row start (16-byte vector loads on CUDA). Every element offset is int64: ``h * head_stride`` alone
    passes 2^31 on a large LHBNC cache (heads outside blocks), and Triton passes a stride below 2^31 as
    int32."""
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    if MODE == 1:  # SCATTER (module constants are not visible in compiled kernels: literals here)
        slot = tl.load(dst_ptr + i)
    else:
        slot = tl.load(src_ptr + i)
    if slot >= 0:
        at = _token_at(
            layer_off_ptr,
            index_ptr,
            layer,
            slot,
            block_stride,
            token_stride,
            BLOCK_SIZE,
            WIDTH,
            WIDTH_P2,
            STRIDED,
            ALIGN,
        )
        if MODE == 2:  # DIRECT
            to = _token_at(
                layer_off_ptr,
                index_ptr,
                layer,
                tl.load(dst_ptr + i),
                block_stride,
                token_stride,
                BLOCK_SIZE,
                WIDTH,
                WIDTH_P2,
                STRIDED,
                ALIGN,
            )
        c = tl.arange(0, WIDTH_P2)[None, :]
        for h0 in range(0, HEADS, HEAD_TILE):
            h = h0 + tl.arange(0, HEAD_TILE)[:, None]
            ok = (h < HEADS) & (c < WIDTH)
            head = cache_ptr + h.to(tl.int64) * head_stride
            stage_at = stage_ptr + ((layer * CAP + i) * HEADS + h) * WIDTH + c
            if MODE == 0:  # GATHER
                tl.store(stage_at, tl.load(head + at, mask=ok), mask=ok)
            elif MODE == 1:
                tl.store(head + at, tl.load(stage_at, mask=ok), mask=ok)
            else:
                tl.store(head + to, tl.load(head + at, mask=ok), mask=ok)


_COPY = TritonKernel(_token_copy, helpers=(_token_at,))
KERNELS = {"_token_copy": _COPY}  # by name, for the device check's compiled-variant counts


class TritonSlotMover:
    """``SlotMover`` on any ``PagedLayout``; CUDA tensors compiled, CPU tensors through Triton's interpreter.

    Holds two ``capacity``-long slot buffers and, once a staged launch ran, a staging buffer of ``layers ×
    capacity × H × 2D`` elements of the cache dtype (Llama-3-8B, bf16, capacity 512: 64 MiB).
    """

    def __init__(self, layout: PagedLayout, capacity: int = 512) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: need at least 1")
        self.layout = layout
        self.capacity = capacity
        self._key: tuple | None = None
        self._caches: list[torch.Tensor] = []
        self._offsets: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None
        self._src: torch.Tensor | None = None
        self._dst: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._align = 1

    # ---------------------------------------------------------------- setup (once per set of layer tensors)
    def prepare(self, kv_caches: Sequence[torch.Tensor], staged: bool = True) -> None:
        """Check the layer tensors agree with the layout; allocate the slot (and, ``staged``, staging)
        buffers. Idempotent."""
        caches = unique_caches(kv_caches)
        key = tuple(kv.data_ptr() for kv in caches)
        if key != self._key:
            first = caches[0]
            for kv in caches:
                if kv.shape != first.shape or kv.stride() != first.stride() or kv.dtype != first.dtype:
                    raise ValueError("TritonSlotMover: the layer caches differ in shape, strides or dtype")
                if kv.device != first.device:
                    raise ValueError("TritonSlotMover: the layer caches are on different devices")
            check_view(first, self.layout)
            esize = first.element_size()
            deltas = [kv.data_ptr() - first.data_ptr() for kv in caches]
            if any(d % esize for d in deltas):
                raise ValueError("TritonSlotMover: layer tensors are not element-aligned with each other")
            lay, dev = self.layout, first.device
            self._caches = caches
            self._offsets = torch.tensor([d // esize for d in deltas], dtype=torch.int64, device=dev)
            self._align = math.gcd(
                16, lay.block_stride, lay.head_stride, lay.token_stride or 1, *(d // esize for d in deltas)
            )
            self._src = torch.full((self.capacity,), NO_SLOT, dtype=torch.int64, device=dev)
            self._dst = torch.full((self.capacity,), NO_SLOT, dtype=torch.int64, device=dev)
            self._index = lay.index.to(device=dev, dtype=torch.int32)
            self._stage = None
            self._key = key
        if staged and self._stage is None:
            first, lay = self._caches[0], self.layout
            self._stage = torch.empty(
                len(self._caches), self.capacity, lay.num_kv_heads, lay.width, dtype=first.dtype, device=first.device
            )

    def set_plan(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ≤ ``capacity`` pairs into the persistent slot buffers, the rest NO_SLOT (mutates them
        only)."""
        n = src.numel()
        if n > self.capacity:
            raise ValueError(f"set_plan: {n} moves exceed the capacity {self.capacity}")
        self._src.fill_(NO_SLOT)
        self._dst.fill_(NO_SLOT)
        self._src[:n].copy_(src.reshape(-1), non_blocking=True)
        self._dst[:n].copy_(dst.reshape(-1), non_blocking=True)

    def launch(self, staged: bool = True) -> None:
        """The current plan over every layer (mutates the caches): gather launch then scatter launch, or
        one direct launch (only for disjoint sources and destinations). Fixed grid ``(capacity, layers)``:
        capturable in a CUDA graph after ``prepare`` and ``set_plan``."""
        if staged and self._stage is None:
            raise RuntimeError("launch(staged=True) needs prepare(..., staged=True) first")
        # the direct kernel never touches its stage argument
        self._launch_modes((GATHER, SCATTER) if staged else (DIRECT,), self._stage if staged else self._src)

    def warmup(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Compile (CUDA) the mover's three variants, DIRECT, GATHER and SCATTER, by launching each once over
        an all-padding plan (every slot NO_SLOT): no program reads or writes a cache, every cache byte stays
        as it was. Side effects: ``prepare(kv_caches, staged=False)`` (slot buffers, no staging buffer: the
        staged pair runs on a 16-element scratch stage of the cache dtype that it never touches, the same
        specialisation as the real one), the slot buffers left all padding, three launches on the current
        stream (asynchronous), Triton's compile cache. Call once at start-up, outside graph capture."""
        self.prepare(kv_caches, staged=False)
        self._src.fill_(NO_SLOT)
        self._dst.fill_(NO_SLOT)
        first = self._caches[0]
        self._launch_modes((DIRECT,), self._src)
        self._launch_modes((GATHER, SCATTER), torch.empty(16, dtype=first.dtype, device=first.device))

    def _launch_modes(self, modes: Sequence[int], stage: torch.Tensor) -> None:
        """``_token_copy`` once per mode over the current plan, grid ``(capacity, layers)`` (mutates the caches
        and ``stage`` as the plan says)."""
        lay = self.layout
        first = self._caches[0]
        width_p2 = next_pow2(lay.width)
        head_tile = min(next_pow2(lay.num_kv_heads), max(1, 4096 // width_p2))
        for mode in modes:
            _COPY.launch(
                first.device,
                (self.capacity, len(self._caches)),
                first,
                self._offsets,
                self._src,
                self._dst,
                stage,
                self._index,
                lay.block_stride,
                lay.head_stride,
                lay.token_stride or 0,
                CAP=self.capacity,
                BLOCK_SIZE=lay.block_size,
                HEADS=lay.num_kv_heads,
                HEAD_TILE=head_tile,
                WIDTH=lay.width,
                WIDTH_P2=width_p2,
                STRIDED=lay.token_stride is not None,
                ALIGN=self._align,
                MODE=mode,
            )

    # ---------------------------------------------------------------- SlotMover
    def move(self, kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy token ``src[i]`` onto ``dst[i]`` in every tensor of ``kv_caches`` (mutates them). Direct when
        the plan is on the CPU and its sources and destinations are disjoint, staged otherwise."""
        if src.shape != dst.shape:
            raise ValueError(f"move: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        src, dst = src.reshape(-1), dst.reshape(-1)
        n = src.numel()
        # a plan already on the device is not inspected (that would wait for it): staged, unless chunked
        check = src.device.type == "cpu" or n > self.capacity
        disjoint = check and not bool(torch.isin(src, dst).any())
        if n > self.capacity and not disjoint:
            raise ValueError(
                f"move: {n} moves exceed the capacity {self.capacity} and sources overlap "
                "destinations; chunks would not be exact"
            )
        self.prepare(kv_caches, staged=not disjoint)
        for start in range(0, n, self.capacity):
            self.set_plan(src[start : start + self.capacity], dst[start : start + self.capacity])
            self.launch(staged=not disjoint)
