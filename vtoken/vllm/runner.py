"""The worker side of vToken: a mixin for vLLM's V1 model runner (``GPUModelRunner`` and its CPU subclass).

Per step, in the order vLLM calls it::

    _update_states(so)     1. run the plan's KV slot moves (before vLLM zeroes or appends blocks: a freed
                              tail block may be handed to another request in this same step)
                           2. cut the rows the scheduler shrank to their first ``truncate[req]`` blocks
                           3. vLLM's own update (appends this step's new block ids)
    _prepare_inputs(so)    vLLM's own preparation (positions stay logical → RoPE), then for vToken rows:
                           seq_len -= offset (attention reads the dense live slots), slot mapping from
                           physical positions (logical - offset) or the table's slot (reuse+repack),
                           and the score accumulator for this step
    forward                attention layers: after vLLM's kernel ran, ``impl.forward`` (wrapped per
                           instance) folds q·K of the step's queries over the live keys into the accumulator
    sample_tokens()        vLLM's sampling; the scores and move timings ride back on the ModelRunnerOutput

Nothing here changes vLLM's attention kernels: a request's live tokens always occupy row slots
``0..live-1``, so ``seq_len = live`` is all the kernel needs. ``num_computed_tokens`` stays logical, so the
discard mask, sampling and stop checks are untouched.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import SlotMover, TorchSlotMover
from vtoken.kernels.scores import RequestScores, ScoreAccumulator
from vtoken.vllm.transport import StepPlan, StepResult, attach_result, plan_of

logger = logging.getLogger("vtoken.vllm")


class VTokenRunnerMixin:
    """Mixed in front of vLLM's V1 runner class (the worker switches the runner instance's class)."""

    _vt_ready: bool = False
    _vt_plan: StepPlan | None = None
    _vt_result: StepResult | None = None
    _vt_acc: ScoreAccumulator | None = None
    _vt_layout: TokenLayout | None = None
    _vt_mover: SlotMover | None = None
    _vt_kv_tensors: tuple[torch.Tensor, ...] = ()

    # ------------------------------------------------------------------ setup (once, after KV init)
    def _vt_setup(self) -> None:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeError("vToken supports one KV cache group (full attention) only")
        ctx = self.compilation_config.static_forward_context
        layers = [ctx[name] for name in groups[0].layer_names]
        self._vt_kv_tensors = tuple(layer.kv_cache for layer in layers)
        self._vt_layout = self._vt_probe_layout(layers[0])
        self._vt_mover = self._vt_make_mover(self._vt_layout)
        for layer in layers:
            self._vt_wrap(layer)
        self._vt_ready = True
        logger.info("vToken worker ready: %d attention layers, block size %d", len(layers), self._vt_layout.block_size)

    def _vt_probe_layout(self, layer) -> TokenLayout:
        """CPU: ask the backend's own cache writer where each token's elements go."""
        from vllm import _custom_ops as ops

        from vtoken.kernels.layout import probe_layout

        impl = layer.impl
        kv = layer.kv_cache
        _, nkv, bs, two_hd = kv.shape
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise RuntimeError("vToken: the CPU attention layer has no ISA set (backend changed?)")
        kv_dtype = getattr(impl, "kv_cache_dtype", "auto")
        if kv_dtype not in ("auto", None) and "fp8" in str(kv_dtype):
            raise RuntimeError("vToken does not support quantized (fp8) KV caches yet")

        def writer(k, v, kc, vc, sm):
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, sm, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

        return probe_layout(writer, bs, nkv, two_hd // 2, kv.dtype)

    def _vt_make_mover(self, layout: TokenLayout) -> SlotMover:
        return TorchSlotMover(layout)

    def _vt_wrap(self, layer) -> None:
        """Wrap this layer's ``impl.forward`` (per instance) to score the step's queries after the kernel."""
        impl = layer.impl
        if getattr(impl, "_vtoken_wrapped", False):
            return
        for attr, bad in (("sinks", None), ("alibi_slopes", None)):
            if getattr(impl, attr, None) is not bad:
                raise RuntimeError(f"vToken score collection does not support attention {attr}")
        if getattr(impl, "logits_soft_cap", 0) not in (0, None) or getattr(impl, "sliding_window", -1) not in (-1, None):
            raise RuntimeError("vToken score collection does not support soft-capping or sliding windows")
        orig = impl.forward
        runner = self
        scale = float(impl.scale)

        def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            acc = runner._vt_acc
            if acc is not None and attn_metadata is not None:
                acc.add_layer(query, key, kv_cache, scale)
            return out

        impl.forward = forward
        impl._vtoken_wrapped = True

    # ------------------------------------------------------------------ step hooks
    def _update_states(self, scheduler_output):
        plan = plan_of(scheduler_output)
        self._vt_plan = plan
        self._vt_acc = None
        self._vt_result = StepResult() if plan is not None else None
        if plan:
            if not self._vt_ready:
                self._vt_setup()
            if plan.num_moves:
                t0 = time.perf_counter()
                self._vt_mover.move(self._vt_kv_tensors, torch.from_numpy(plan.src), torch.from_numpy(plan.dst))
                self._vt_sync()
                self._vt_result.move_seconds = time.perf_counter() - t0
                self._vt_result.num_moves = plan.num_moves
            for rid, keep in plan.truncate.items():
                self._vt_truncate(rid, keep)
        return super()._update_states(scheduler_output)

    def _vt_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _vt_truncate(self, rid: str, keep: int) -> None:
        """Cut a request's block row to ``keep`` blocks (cached state and the persistent batch row)."""
        state = self.requests.get(rid)
        if state is not None:
            for ids in state.block_ids:
                del ids[keep:]
        idx = self.input_batch.req_id_to_index.get(rid)
        if idx is not None:
            for bt in self.input_batch.block_table.block_tables:
                n = int(bt.num_blocks_per_row[idx])
                if keep < n:
                    bt.block_table.np[idx, keep:n] = 0
                    bt.num_blocks_per_row[idx] = keep

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        ret = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        plan = self._vt_plan
        if not plan or not plan.requests:
            return ret
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        qsl = self.query_start_loc.np
        offsets = np.zeros(num_reqs, dtype=np.int64)
        rows = self.input_batch.block_table[0]
        acc = ScoreAccumulator(self._vt_layout)
        overrides = []
        for i, rid in enumerate(req_ids):
            rs = plan.requests.get(rid)
            if rs is None:
                continue
            offsets[i] = rs.offset
            if rs.slots is not None:
                overrides.append((i, rs.slots))
        if offsets.any():
            total = int(qsl[num_reqs])
            e_req = torch.from_numpy(offsets)
            self.seq_lens[:num_reqs] -= e_req.to(device=self.seq_lens.device, dtype=self.seq_lens.dtype)
            self.optimistic_seq_lens_cpu[:num_reqs] -= e_req.to(self.optimistic_seq_lens_cpu.dtype)
            e_tok = torch.from_numpy(offsets[self.req_indices.np[:total]]).to(self.positions.device)
            physical = self.positions[:total] - e_tok
            self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)
        B = rows.block_size
        for i, slots in overrides:
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            row = rows.block_table.np[i]
            phys = row[slots // B].astype(np.int64) * B + slots % B
            rows.slot_mapping.gpu[q0:q1] = torch.from_numpy(phys).to(rows.slot_mapping.gpu.device)
        seq_lens = self.optimistic_seq_lens_cpu[:num_reqs].numpy()
        for i, rid in enumerate(req_ids):
            rs = plan.requests.get(rid)
            if rs is None or not (rs.scores or rs.key_norm):
                continue
            n_blocks = int(rows.num_blocks_per_row[i])
            acc.requests[rid] = RequestScores(
                q_start=int(qsl[i]),
                q_end=int(qsl[i + 1]),
                seq_len=int(seq_lens[i]),
                block_row=torch.from_numpy(rows.block_table.np[i, :n_blocks].astype(np.int64)).to(self.device),
                want_attention=rs.scores,
                want_key_norm=rs.key_norm,
                window=rs.window,
            )
        self._vt_acc = acc if acc.requests else None
        return ret

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        out = super().execute_model(scheduler_output, intermediate_tensors)
        if out is not None:  # no forward this step (vLLM returned early): report the moves now
            out = self._vt_attach(out)
        return out

    def sample_tokens(self, grammar_output):
        return self._vt_attach(super().sample_tokens(grammar_output))

    def _vt_attach(self, out):
        res, self._vt_result = self._vt_result, None
        acc, self._vt_acc = self._vt_acc, None
        if res is None:
            return out
        if acc is not None:
            res.scores = acc.finish()
        if not (res.scores or res.num_moves):
            return out
        from vllm.v1.outputs import ModelRunnerOutput

        if isinstance(out, ModelRunnerOutput):
            return attach_result(out, res)
        inner = getattr(out, "_model_runner_output", None)  # V1 async output (GPU async scheduling)
        if isinstance(inner, ModelRunnerOutput):
            out._model_runner_output = attach_result(inner, res)
        return out
