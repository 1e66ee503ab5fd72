"""The worker side of vToken: a mixin for vLLM's V1 model runner (``GPUModelRunner`` and its CPU subclass).

At start-up, when vLLM builds the KV cache (``initialize_kv_cache``): every attention layer is checked
(``vtoken.vllm.supported_configs.check_attention_layer``: ALiBi, soft cap, sinks, window, quantized cache are refused
there, so engine construction fails instead of a first request), the layout is probed, the mover built,
``impl.forward`` wrapped, and with tensor parallelism the score reduction set up (vtoken/vllm/runner/tp.py).

Per step, in the order vLLM calls it::

    _update_states(so)     1. run the plan's KV slot moves (before vLLM zeroes or appends blocks: a freed
                              tail block may be handed to another request in this same step)
                           2. put copy-on-write replacements into the rows (``replace[req]``: the moves
                              already addressed them physically; the kernel must read the same row as vLLM)
                           3. cut the rows the scheduler shrank to their first ``truncate[req]`` blocks
                           4. vLLM's own update (appends this step's new block ids)
    _prepare_inputs(so)    vLLM's own preparation (positions stay logical → RoPE), then for vToken rows:
                           seq_len -= offset (attention reads the dense live slots), slot mapping from
                           physical positions (logical - offset) or the table's slot (reuse+repack),
                           and the score accumulator for this step
    forward                attention layers: after vLLM's kernel ran, ``impl.forward`` (wrapped per
                           instance) folds q·K of the step's queries over the live keys into the accumulator;
                           under CUDA graphs with a ``score_layers`` subset it only copies the scored
                           layers' queries into persistent buffers (vtoken/vllm/runner/score_capture.py)
    execute_model()        after the forward: the buffered queries scored (that case), the new keys' norms
                           read back from the cache (KNorm); both work under FULL CUDA graphs, which do not
                           replay Python
    sample_tokens()        vLLM's sampling; with TP > 1 the step's score buffers are all-reduced over the
                           TP group (every rank, same order); the scores and move timings ride back on
                           the ModelRunnerOutput (with async scheduling they are copied to pinned host
                           memory on a side stream now and reduced when the output is read: HostReadback)

Attention kernels are unchanged: live tokens occupy row slots ``0..live-1``, so ``seq_len = live`` is all the
kernel needs; ``num_computed_tokens`` stays logical (discard mask, sampling, stop checks). The platform
classes (``vtoken/vllm/runner/cpu.py``, ``gpu.py``) supply the layout, the mover and the score
accumulator through the ``_vt_make_*`` hooks.
All device work is enqueued on the current stream, after the previous step's forward (async scheduling
relies on that order, as vLLM itself does for freed blocks); host→device copies go through pinned memory.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput

from vtoken.core.config import score_layer_indices
from vtoken.kernels.gpu_layout import PagedLayout, key_offsets, read_k
from vtoken.kernels.moves import SlotMover, unique_caches
from vtoken.kernels.scores import LayerGroups, RequestScores, ScoreAccumulator
from vtoken.vllm.runner.score_capture import QueryCapture, query_capture
from vtoken.vllm.runner.step_result import DeferredResultOutput, HostReadback, attach_step_result
from vtoken.vllm.transport import StepPlan, StepResult, plan_of

logger = logging.getLogger("vtoken.vllm")


if TYPE_CHECKING:  # the type checker sees vLLM's runner this is mixed into; at run time a plain mixin
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as _RunnerBase
else:
    _RunnerBase = object


class VTokenRunnerMixin(_RunnerBase):
    """Mixed in front of vLLM's V1 runner class (the worker builds or switches the runner to it)."""

    _vt_ready: bool = False
    _vt_plan: StepPlan | None = None
    _vt_result: StepResult | None = None
    _vt_acc: LayerGroups | ScoreAccumulator | None = None
    _vt_depth: int = 0  # attention layers (the depth ``score_layers`` is spread over)
    _vt_layout: Any = None  # what the mover and the accumulator read through (platform-specific)
    _vt_paged: PagedLayout  # the same layout as a PagedLayout (key norms); set at KV set-up
    _vt_mover: SlotMover  # set at KV set-up
    _vt_kv_tensors: tuple[torch.Tensor, ...] = ()
    _vt_norm_reqs: dict[str, tuple[int, int, int]] | None = None  # rid -> (start, end) in the norms, seq_len
    _vt_norm_slots: torch.Tensor | None = None
    _vt_norm_sum: torch.Tensor | None = None  # Σ over layers of the new keys' mean-over-heads L2 norms
    _vt_norm_layers: int = 1
    _vt_timer: tuple | None = None  # CUDA events around the moves (read when the result is finished)
    _vt_tp: object = None  # TPReducer with tensor parallelism (vtoken/vllm/runner/tp.py), else None
    _vt_readback: HostReadback | None = None  # CUDA: async outputs' statistics copied on a side stream
    _vt_capture: QueryCapture | None = None  # CUDA graphs + a layer subset: queries buffered, scored after
    _vt_knorm: Any = None  # CUDA: TritonKeyNorms (every layer's key norms in one launch), else None
    _vt_tokens: int = 0  # this step's scheduled tokens (the rows of the query buffers its requests index)
    _vt_group: int = 0  # the KV cache group vToken manages (the full-attention one on hybrid models)
    _vt_logical_lens: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's logical seq_lens (device,
    # host) when offsets made the shared ones physical and other KV cache groups need them (hybrid models)

    # ------------------------------------------------------------------ platform hooks
    def _vt_make_layout(self, layer) -> tuple[object, PagedLayout]:
        """``(layout for the mover and accumulator, the same as a PagedLayout)`` of the layers' caches."""
        raise NotImplementedError

    def _vt_make_mover(self, layout) -> SlotMover:
        raise NotImplementedError

    def _vt_make_accumulator(self, layout) -> ScoreAccumulator:
        """A fresh accumulator for one step's attention statistics."""
        raise NotImplementedError

    def _vt_make_key_norms(self, layout):
        """Every layer's key norms in one launch (``TritonKeyNorms``-like: ``sum(caches, slots)``), or
        ``None``: ``_vt_key_norms`` reads them layer by layer with torch (the CPU)."""
        return None

    def _vt_warmup(self, layers) -> None:
        """Compile what the steps will launch, once, at start-up (platforms with JIT kernels override)."""

    def _vt_make_readback(self) -> HostReadback | None:
        """How async outputs read the step's statistics back (``None``: they are host tensors already)."""
        return None

    # ------------------------------------------------------------------ setup (start-up, at KV init)
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs) -> None:
        """vLLM builds the KV cache; then vToken checks every attention layer and sets up (raises
        ``ConfigError`` for a model feature vToken refuses: engine construction fails, no request runs)."""
        super().initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling and self._vt_enabled():
            self._vt_setup()

    def _vt_enabled(self) -> bool:
        from vtoken.vllm.config import EngineSettings

        cfg = self.vllm_config
        return EngineSettings.from_additional_config(cfg.additional_config, cfg.cache_config.block_size).enabled

    def _vt_setup(self) -> None:
        """Check the layers, probe the layout, build the mover, wrap ``impl.forward`` (mutates the layers'
        impls; idempotent: a rebuilt cache is set up again)."""
        from vtoken.vllm.runner.tp import tp_reducer
        from vtoken.vllm.supported_configs import check_attention_layer, full_attention_group

        groups = self.kv_cache_config.kv_cache_groups
        self._vt_group = full_attention_group(groups)  # other mixes: ConfigError naming the groups' kinds
        if len(groups) > 1 and self.device.type == "cuda":  # unproven there: CUDA graphs capture seq_lens
            from vtoken.vllm.supported_configs import refuse

            refuse(
                f"a hybrid model ({len(groups)} KV cache groups) on CUDA: the per-group lengths are proven on "
                "the CPU backend only (CUDA graphs replay the shared seq_lens buffer)"
            )
        ctx = self.compilation_config.static_forward_context
        names = groups[self._vt_group].layer_names
        layers = [ctx[name] for name in names]
        for name, layer in zip(names, layers):
            check_attention_layer(name, layer.impl)
        self._vt_wrap_window_builders()
        self._vt_kv_tensors = tuple(layer.kv_cache for layer in layers)
        vllm_config = getattr(self, "vllm_config", None)
        self._vt_tp = tp_reducer(vllm_config) if vllm_config is not None else None
        self._vt_layout, self._vt_paged = self._vt_make_layout(layers[0])
        self._vt_mover = self._vt_make_mover(self._vt_layout)
        self._vt_knorm = self._vt_make_key_norms(self._vt_paged)
        self._vt_readback = self._vt_make_readback()
        self._vt_depth = len(layers)
        order = _forward_order(names)
        self._vt_capture = query_capture(self, layers, order)
        if self._vt_capture is not None:  # scored layers copy their queries (graph-safe); scored after
            self._vt_capture.wrap()
        else:
            for index, layer in zip(order, layers):
                self._vt_wrap(layer, index)
        self._vt_warmup(layers)
        self._vt_ready = True
        logger.info(
            "vToken worker ready: %d attention layers (KV cache group %d of %d), block size %d, mover %s",
            len(layers),
            self._vt_group,
            len(groups),
            self._vt_paged.block_size,
            type(self._vt_mover).__name__,
        )

    def _vt_wrap_window_builders(self) -> None:
        """Hybrid models: wrap ``build`` of every other group's attention metadata builders (per instance) so
        that their layers see the logical ``seq_lens`` (``_vt_logical_lens``): ``_prepare_inputs`` makes the
        shared ``seq_lens`` physical for the full-attention group, while a sliding-window group's rows and
        slot mappings stay vLLM's logical ones (its window is counted in logical positions)."""
        import dataclasses

        runner = self
        for gid, attn_groups in enumerate(self.attn_groups):
            if gid == self._vt_group:
                continue
            for attn_group in attn_groups:
                for builder in getattr(attn_group, "metadata_builders", ()):
                    if getattr(builder, "_vtoken_wrapped", False):
                        continue
                    orig = builder.build

                    def build(common_prefix_len, cm, *args, _orig=orig, **kwargs):
                        lens = runner._vt_logical_lens
                        if lens is not None:  # (device lengths, host lengths) of the batch's real requests
                            n = lens[0].shape[0]
                            logical, upper = cm.seq_lens.clone(), cm.seq_lens_cpu_upper_bound
                            logical[:n] = lens[0]
                            if upper is not None:
                                upper = upper.clone()
                                upper[:n] = lens[1]
                            cm = dataclasses.replace(
                                cm,
                                seq_lens=logical,
                                seq_lens_cpu_upper_bound=upper,
                                max_seq_len=max(cm.max_seq_len, int(lens[1].max())),
                            )
                        return _orig(common_prefix_len, cm, *args, **kwargs)

                    builder.build = build
                    builder._vtoken_wrapped = True

    def _vt_wrap(self, layer, index: int | None = None) -> None:
        """Wrap this layer's ``impl.forward`` (per instance) to score the step's queries after the kernel;
        ``index``: the layer's place in the forward order (the accumulator skips it unless a request's
        ``score_layers`` subset holds it)."""
        impl = layer.impl
        if getattr(impl, "_vtoken_wrapped", False):
            return
        orig = impl.forward
        runner = self
        scale = float(impl.scale)

        def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            acc = runner._vt_acc
            if acc is not None and attn_metadata is not None:
                acc.add_layer(query, None, kv_cache, scale, layer=index)
            return out

        impl.forward = forward
        impl._vtoken_wrapped = True

    def _vt_h2d(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the runner's device; on CUDA through pinned memory, without waiting for the stream."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ step hooks
    def _update_states(self, scheduler_output):
        plan = plan_of(scheduler_output)
        self._vt_plan, self._vt_acc, self._vt_norm_reqs, self._vt_norm_slots, self._vt_norm_sum = (
            plan,
            None,
            None,
            None,
            None,
        )
        self._vt_result = StepResult(step=plan.step) if plan is not None else None
        if plan:
            if not self._vt_ready:  # never lazily: every check belongs to start-up (initialize_kv_cache)
                raise RuntimeError(
                    "vToken: a step plan reached a worker that was not set up when its KV cache "
                    "was built (worker_cls must be vToken's and additional_config enable it)"
                )
            if plan.num_moves:
                self._vt_move(plan)
            for rid, blocks in plan.replace.items():
                self._vt_replace(rid, blocks)
            for rid, keep in plan.truncate.items():
                self._vt_truncate(rid, keep)
        return super()._update_states(scheduler_output)

    def _vt_move(self, plan: StepPlan) -> None:
        """All of the plan's moves, every layer (mutates the KV caches; timed into the step's result)."""
        result = self._vt_result
        assert result is not None, "a step's result exists from its plan on (_update_states)"
        src, dst = torch.from_numpy(plan.src), torch.from_numpy(plan.dst)
        result.num_moves = plan.num_moves
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._vt_mover.move(self._vt_kv_tensors, src.pin_memory(), dst.pin_memory())
            end.record()
            self._vt_timer = (start, end)
            return
        t0 = time.perf_counter()
        self._vt_mover.move(self._vt_kv_tensors, src, dst)
        result.move_seconds = time.perf_counter() - t0

    def _vt_replace(self, rid: str, blocks: dict[int, int]) -> None:
        """Put ``blocks[index]`` at ``index`` of a request's block row (cached state and the persistent batch
        row); the replaced block ids leave the row (the scheduler released them)."""
        state = self.requests.get(rid)
        if state is not None:
            ids = state.block_ids[self._vt_group]
            for index, block_id in blocks.items():
                ids[index] = block_id
        idx = self.input_batch.req_id_to_index.get(rid)
        if idx is not None:
            bt = self.input_batch.block_table[self._vt_group]
            n = int(bt.num_blocks_per_row[idx])
            for index, block_id in blocks.items():
                if index >= n:
                    raise RuntimeError(f"vToken: request {rid} replaces row index {index} of {n}")
                bt.block_table.np[idx, index] = block_id

    def _vt_truncate(self, rid: str, keep: int) -> None:
        """Cut a request's block row to ``keep`` blocks (cached state and the persistent batch row)."""
        state = self.requests.get(rid)
        if state is not None:
            del state.block_ids[self._vt_group][keep:]
        idx = self.input_batch.req_id_to_index.get(rid)
        if idx is not None:
            bt = self.input_batch.block_table[self._vt_group]
            n = int(bt.num_blocks_per_row[idx])
            if keep < n:
                bt.block_table.np[idx, keep:n] = 0
                bt.num_blocks_per_row[idx] = keep

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        ret = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        plan = self._vt_plan
        self._vt_logical_lens = None
        if not plan or not plan.requests:
            return ret
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        qsl = self.query_start_loc.np
        offsets = np.zeros(num_reqs, dtype=np.int64)
        rows = self.input_batch.block_table[self._vt_group]
        overrides = []
        for i, rid in enumerate(req_ids):
            rs = plan.requests.get(rid)
            if rs is not None:
                offsets[i] = rs.offset
                if rs.slots is not None:
                    overrides.append((i, rs.slots))
        if offsets.any():
            total = int(qsl[num_reqs])
            if len(self.input_batch.block_table.block_tables) > 1:  # other groups keep the logical lengths
                self._vt_logical_lens = (
                    self.seq_lens[:num_reqs].clone(),
                    self.optimistic_seq_lens_cpu[:num_reqs].clone(),
                )
            self.seq_lens[:num_reqs] -= self._vt_h2d(offsets).to(self.seq_lens.dtype)
            cpu_lens = self.optimistic_seq_lens_cpu
            cpu_lens[:num_reqs] -= torch.from_numpy(offsets).to(cpu_lens.dtype)
            physical = self.positions[:total] - self._vt_h2d(offsets[self.req_indices.np[:total]])
            rows.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)
        B = rows.block_size
        for i, slots in overrides:
            row = rows.block_table.np[i]
            phys = row[slots // B].astype(np.int64) * B + slots % B
            rows.slot_mapping.gpu[int(qsl[i]) : int(qsl[i + 1])] = self._vt_h2d(phys)
        self._vt_collect(plan, req_ids, qsl, rows)
        return ret

    def _vt_collect(self, plan: StepPlan, req_ids, qsl, rows) -> None:
        """This step's score accumulator and key-norm requests (``_vt_acc``, ``_vt_norm_*``)."""
        seq_lens = self.optimistic_seq_lens_cpu[: len(req_ids)].numpy()
        accs: dict[frozenset[int] | None, ScoreAccumulator] = {}
        norms, slots, at = {}, [], 0
        for i, rid in enumerate(req_ids):
            rs = plan.requests.get(rid)
            if rs is None:
                continue
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            if rs.scores:
                n_blocks = int(rows.num_blocks_per_row[i])
                subset = (
                    None
                    if rs.score_layers is None or rs.score_layers >= self._vt_depth
                    else (frozenset(score_layer_indices(rs.score_layers, self._vt_depth)))
                )
                if self._vt_capture is not None:
                    self._vt_capture.check_covers(rid, subset)
                if subset not in accs:
                    accs[subset] = self._vt_make_accumulator(self._vt_layout)
                accs[subset].requests[rid] = RequestScores(
                    q_start=q0,
                    q_end=q1,
                    seq_len=int(seq_lens[i]),
                    block_row=torch.from_numpy(rows.block_table.np[i, :n_blocks].astype(np.int64)),
                    want_attention=True,
                    want_key_norm=False,
                    window=rs.window,
                    want_redundancy=rs.redundancy,
                    first=rs.first,
                )
            if rs.key_norm:
                n = q1 - q0 + rs.norm_back  # norm_back: cache-hit keys before the new ones (row slots)
                if rs.norm_back:
                    pos = np.arange(int(seq_lens[i]) - n, int(seq_lens[i]) - (q1 - q0))
                    phys = rows.block_table.np[i][pos // rows.block_size].astype(np.int64) * rows.block_size
                    slots.append(self._vt_h2d(phys + pos % rows.block_size).to(rows.slot_mapping.gpu.dtype))
                norms[rid] = (at, at + n, int(seq_lens[i]))
                slots.append(rows.slot_mapping.gpu[q0:q1])
                at += n
        order = sorted(accs, key=lambda s: (s is not None, sorted(s or ())))  # same on every TP rank
        self._vt_acc = LayerGroups([(s, accs[s]) for s in order]) if accs else None
        self._vt_tokens = int(qsl[len(req_ids)])
        self._vt_norm_reqs = norms or None
        self._vt_norm_slots = torch.cat(slots) if slots else None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        out = super().execute_model(scheduler_output, intermediate_tensors)
        if self._vt_capture is not None and self._vt_acc is not None:  # the forward filled the buffers
            self._vt_capture.score(self._vt_acc, self._vt_tokens)
        if self._vt_norm_slots is not None:
            self._vt_key_norms()
        if out is not None:  # no forward this step (vLLM returned early): report the moves now
            out = self._vt_attach(out)
        return out

    def _vt_key_norms(self) -> None:
        """Σ over layers of the new keys' L2 norms (mean over kv heads), read from the cache after the
        forward wrote them: ``_vt_norm_sum`` (device tensor, reduced to host when the result is finished)."""
        caches, new = unique_caches(self._vt_kv_tensors), self._vt_norm_slots
        assert new is not None, "called only for a step with new keys to norm"
        if self._vt_knorm is not None:  # one launch for every layer (CUDA)
            self._vt_norm_sum = self._vt_knorm.sum(caches, new)
            self._vt_norm_layers = len(caches)
            return
        total, offsets = None, {}  # per device: the keys' element offsets, the same for every layer
        for kv in caches:
            slots = new.to(kv.device)
            if kv.device not in offsets:
                offsets[kv.device] = key_offsets(self._vt_paged, slots)
            keys = read_k(kv, self._vt_paged, slots, offsets[kv.device]).float()
            n = keys.norm(dim=-1).mean(dim=-1)
            total = n if total is None else total + n
        self._vt_norm_sum, self._vt_norm_layers = total, len(caches)

    def sample_tokens(self, grammar_output):
        return self._vt_attach(super().sample_tokens(grammar_output))

    def _vt_attach(self, out):
        """Attach this step's ``StepResult`` to the output; for an async output, when it is read."""
        res, self._vt_result = self._vt_result, None
        if res is None:
            return out
        if self._vt_tp is not None:  # every rank, same buffers in the same order (the plan fixes them)
            self._vt_tp.reduce(self._vt_acc, self._vt_norm_sum)
            if not self._vt_tp.output:  # vLLM drops this rank's output: no read-back, no finish
                self._vt_acc, self._vt_norm_reqs, self._vt_norm_sum = None, None, None
        parts = (res, self._vt_acc, self._vt_norm_reqs, self._vt_norm_sum, self._vt_norm_layers, self._vt_timer)
        self._vt_acc, self._vt_norm_reqs, self._vt_norm_sum, self._vt_timer = None, None, None, None
        if isinstance(out, AsyncModelRunnerOutput):
            ready = None
            if self._vt_readback is not None:  # copy now (after this step's work), wait only for the copy
                parts, ready = self._vt_readback.start(parts)
            return DeferredResultOutput(out, parts, ready)
        return attach_step_result(out, parts)


def _forward_order(layer_names: list[str]) -> list[int]:
    """Each attention layer's place in the forward order, from the layer index vLLM reads from its name
    (``model.layers.12.self_attn.attn`` → 12); the listed order when a name carries none. Pure."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        found = [extract_layer_index(name) for name in layer_names]
    except (AssertionError, ValueError):
        return list(range(len(layer_names)))
    rank = {idx: r for r, idx in enumerate(sorted(set(found)))}
    if len(rank) != len(found):
        return list(range(len(layer_names)))
    return [rank[idx] for idx in found]
