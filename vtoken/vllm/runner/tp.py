"""Tensor parallelism: one step's scores reduced over the tensor-parallel group, on every rank.

With TP = t each worker holds ``H/t`` query heads and ``max(1, K/t)`` KV heads (vLLM replicates the KV
heads when ``t > K``, e.g. MQA: every rank holds the one KV head). Only one rank's ``ModelRunnerOutput``
reaches the scheduler, so before the step's statistics leave the worker they are summed over the group:

    attention  each rank accumulates the mean over *its* query heads of softmax(q·Kᵀ) (per layer, summed
               over layers); Σ_ranks (local mean · H_local / H) is the mean over all H query heads — the
               TP = 1 statistic. Scissorhands' low-attention bits, the last query's row and SnapKV's window
               are derived from these reduced probabilities afterwards (``finish``), never per rank.
    key norms  each rank's mean over its KV heads of ‖k_h‖; a replicated head sits on ``replicas = t·K_local/K``
               ranks, so Σ_ranks (local mean · K_local / (K · replicas)) is the mean over the K distinct
               heads — no KV head counted twice. R-KV's ``redundancy`` (per KV head, each live key's mean
               cosine similarity to the others) is a mean over KV heads too and is reduced with the norms.

Every buffer is a linear accumulator, so one all-reduce per step covers all of them: the buffers are
flattened in an order fixed by the step's plan (identical on every rank), summed with vLLM's TP group
(``GroupCoordinator.all_reduce``: gloo on CPU, NCCL on CUDA, enqueued on the current stream), scaled and
written back in place. Moves and truncations need no reduction: the ``StepPlan`` reaches every rank inside
the ``SchedulerOutput`` vLLM broadcasts, and each rank applies it to its own head shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShards:
    """How vLLM shards one model's attention heads over ``tp`` ranks (pure)."""

    tp: int
    q_heads: int  # query heads of the whole model
    kv_heads: int  # distinct KV heads of the whole model

    def __post_init__(self) -> None:
        if self.q_heads % self.tp:
            raise ValueError(f"{self.q_heads} query heads do not split over {self.tp} ranks")
        if max(self.kv_heads, self.tp) % min(self.kv_heads, self.tp):
            raise ValueError(f"{self.kv_heads} KV heads do not shard or replicate evenly over {self.tp} ranks")

    @property
    def kv_local(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (1 unless ``tp > kv_heads``)."""
        return self.tp * self.kv_local // self.kv_heads

    @property
    def q_weight(self) -> float:
        return (self.q_heads // self.tp) / self.q_heads

    @property
    def kv_weight(self) -> float:
        return self.kv_local / (self.kv_heads * self.replicas)


def reduce_buffers(
    attention: Sequence[torch.Tensor],
    norms: Sequence[torch.Tensor],
    shards: HeadShards,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Sum ``attention`` (per-rank head means of probabilities) and ``norms`` (per-rank means of KV-head
    norms) over the group with one ``all_reduce`` call, weighted as in the module docstring; mutates the
    tensors in place. Every rank must call it with buffers of the same shapes in the same order."""
    tensors = [*attention, *norms]
    if not tensors:
        return
    weights = [shards.q_weight] * len(attention) + [shards.kv_weight] * len(norms)
    flat = torch.cat([t.reshape(-1).to(torch.float32) * w for t, w in zip(tensors, weights)])
    total = all_reduce(flat)
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(total[at : at + n].view(t.shape).to(t.dtype))
        at += n


class TPReducer:
    """The reduction for one worker: vLLM's TP group and the model's head shards. ``output``: whether this
    rank's ``ModelRunnerOutput`` reaches the scheduler (TP rank 0: vLLM's executors reply from the first TP
    worker of the last pipeline stage, and vToken runs with PP = 1); the others join the all-reduce and then
    drop the step's statistics without reading them back or finishing them (``VTokenRunnerMixin._vt_attach``).
    """

    def __init__(self, group, shards: HeadShards, output: bool = True) -> None:
        self.group, self.shards, self.output = group, shards, output

    def reduce(self, acc, norm_sum: torch.Tensor | None) -> None:
        """All-reduce the step's accumulator buffers and the key-norm sums (mutates them in place)."""
        attention, norms = acc.linear_buffers() if acc is not None else ([], [])
        norms = [*norms, *([norm_sum] if norm_sum is not None else [])]
        reduce_buffers(attention, norms, self.shards, self.group.all_reduce)


def tp_reducer(vllm_config) -> TPReducer | None:
    """The worker's reducer when it runs with TP > 1 inside vLLM's initialised groups; else ``None``."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    mc = vllm_config.model_config
    shards = HeadShards(
        tp=group.world_size,
        q_heads=mc.get_num_attention_heads(vllm_config.parallel_config) * tp,
        kv_heads=mc.get_total_num_kv_heads(),
    )
    return TPReducer(group, shards, output=group.rank_in_group == 0)
