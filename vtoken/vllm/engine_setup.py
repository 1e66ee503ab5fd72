"""What vToken decides about vLLM's engine when it is built: which model runner, which CUDA-graph mode.

Both choices are made on *the engine's own* ``VllmConfig`` object, by the vToken worker (before its model
runner is built or its model compiled) and again by the vToken scheduler (on the engine core's copy, which
is a different object when the workers run in other processes); the same inputs give the same answer in
every process. Nothing here reads or writes ``os.environ`` or patches a class.

Model runner (``pin_v1_model_runner``): vLLM 0.32 runs Model Runner V2 by default wherever Triton is
usable (CUDA), decided by the property ``VllmConfig.use_v2_model_runner`` from ``VLLM_USE_V2_MODEL_RUNNER``
(unset) and the config. vToken hooks the V1 runner (``GPUModelRunner`` and its CPU subclass), so the
engine's config object is switched to ``V1RunnerVllmConfig``, the same class with that property answering
False (it pickles by reference, so worker processes get it too). What cannot be done for the user fails
with ``ConfigError`` naming the setting: ``VLLM_USE_V2_MODEL_RUNNER=1``, HiSparse and watermarking (they
require V2), a config class vToken does not know, or a feature V1 refuses (vLLM's own V1 check).

CUDA graphs (``choose_cudagraph_mode``): the moves and the edited ``seq_lens`` / slot mapping / block table
live in the persistent buffers vLLM updates before every replay, so FULL graphs replay vToken steps
correctly. What a FULL graph does not replay is Python. Three cases:

* query-free policies (random, streamingllm, knorm: key norms are read from the cache after the forward)
  keep vLLM's mode;
* attention statistics from a subset of the layers (``score_layers`` below the model's depth; 1 by default)
  keep vLLM's mode too: those layers' queries are copied into persistent buffers inside the (captured)
  forward, a graph-safe ``copy_``, and scored after it (``vtoken/vllm/runner/score_capture.py``);
* attention statistics from every layer (``score_layers: null`` or ≥ depth) get ``PIECEWISE`` when attention
  is split out of the captured pieces (vLLM's ``is_attention_compiled_piecewise``), so the per-layer
  ``impl.forward`` wrapper runs eagerly, and ``NONE`` otherwise (``splitting_ops=[]``, attention fusion, a
  mode that does not split), logged with the reason (one query buffer per layer would cost as much memory as
  a layer of activations per layer).
"""

from __future__ import annotations

import logging

from vllm.config import VllmConfig

from vtoken.errors import ConfigError

logger = logging.getLogger("vtoken.vllm")

V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class V1RunnerVllmConfig(VllmConfig):
    """vLLM's ``VllmConfig`` with ``use_v2_model_runner`` pinned to False (see the module docstring)."""

    @property
    def use_v2_model_runner(self) -> bool:
        return False


def pin_v1_model_runner(vllm_config) -> None:
    """Make this engine's config select vLLM's V1 model runner (switches the object's class; idempotent).
    Raises ``ConfigError`` naming the setting when V1 cannot be selected for this engine."""
    from vllm import envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ConfigError(
            f"vToken hooks vLLM's V1 model runner, but {V2_ENV}=1 selects Model Runner V2; "
            f"unset {V2_ENV} (vToken then selects V1 itself) or set {V2_ENV}=0"
        )
    if isinstance(vllm_config, V1RunnerVllmConfig):
        return
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        raise ConfigError(
            "vToken hooks vLLM's V1 model runner; HiSparse (attention_config.hisparse_config) "
            "requires Model Runner V2: turn HiSparse off to run vToken"
        )
    if getattr(vllm_config, "watermark_config", None) is not None:
        raise ConfigError(
            "vToken hooks vLLM's V1 model runner; watermarking (watermark_config) requires "
            "Model Runner V2: turn it off to run vToken"
        )
    if type(vllm_config) is not VllmConfig:
        if not vllm_config.use_v2_model_runner:
            return
        raise ConfigError(
            f"vToken hooks vLLM's V1 model runner and cannot pin it on a "
            f"{type(vllm_config).__qualname__}; set {V2_ENV}=0"
        )
    was_v2 = vllm_config.use_v2_model_runner
    vllm_config.__class__ = V1RunnerVllmConfig
    try:
        vllm_config._validate_v1_model_runner()
    except ValueError as e:
        vllm_config.__class__ = VllmConfig
        raise ConfigError(f"vToken needs vLLM's V1 model runner, which refuses this engine: {e}") from e
    if was_v2:
        logger.info(
            "vToken: using vLLM's V1 model runner for this engine (Model Runner V2 is not hooked; "
            "the default would have been V2). No %s needed.",
            V2_ENV,
        )


def needs_attention_scores(settings) -> bool:
    """Whether an engine with these ``EngineSettings`` collects q·K statistics (pure)."""
    if not settings.enabled or settings.scores == "never":
        return False
    return settings.scores == "always" or settings.cfg.policy_class.needs_attention()


def attention_outside_graphs(cc) -> bool:
    """Whether every attention op runs eagerly between captured pieces under this ``CompilationConfig``
    (vLLM's ``is_attention_compiled_piecewise``: the splitting ops hold every attention op, and either the
    Dynamo-level split of ``VLLM_COMPILE`` or Inductor's graph partition cuts the graph there). Pure."""
    return bool(cc.is_attention_compiled_piecewise())


def _graph_split_reason(cc) -> str:
    """Which setting keeps attention inside the captured graph (for the log line). Pure."""
    from vllm.config.compilation import CompilationMode

    if cc.mode != CompilationMode.VLLM_COMPILE and not cc.use_inductor_graph_partition:
        return f"compilation_config.mode={getattr(cc.mode, 'name', cc.mode)} does not split the graph"
    if getattr(cc.pass_config, "fuse_attn_quant", False) and not cc.use_inductor_graph_partition:
        return "compilation_config.pass_config.fuse_attn_quant fuses attention into the graph"
    return f"compilation_config.splitting_ops={cc.splitting_ops!r} do not split attention out"


def model_depth(vllm_config) -> int:
    """The model's attention layers on this pipeline stage (vLLM's ``ModelConfig
    .get_num_layers_by_block_type(parallel_config, "attention")``): the depth ``score_layers`` is compared
    with when the CUDA-graph mode is chosen. Pure."""
    return int(vllm_config.model_config.get_num_layers_by_block_type(vllm_config.parallel_config, "attention"))


def scores_every_layer(settings, depth: int) -> bool:
    """Whether an engine's attention statistics come from every one of ``depth`` attention layers
    (``score_layers`` null or ≥ depth). Pure."""
    n = settings.cfg.score_layers
    return n is None or n >= depth


def captures_queries(vllm_config, settings) -> bool:
    """Whether this engine scores through persistent query buffers (``vtoken/vllm/runner/score_capture.py``): it
    collects attention statistics from a subset of the layers and may capture attention in a CUDA graph
    (a graph replays the buffer copies, never the Python score hook). Not under NONE, nor under PIECEWISE
    with attention split out of the pieces: there the per-layer hook runs eagerly and serves any request's
    ``score_layers``. The runner asks this at KV set-up, after ``choose_cudagraph_mode`` ran on the same
    config, so both sides see the same answer. Pure."""
    from vllm.config.compilation import CUDAGraphMode

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE or not needs_attention_scores(settings):
        return False
    if mode == CUDAGraphMode.PIECEWISE and attention_outside_graphs(cc):
        return False
    return not scores_every_layer(settings, model_depth(vllm_config))


def choose_cudagraph_mode(vllm_config, settings) -> bool:
    """Apply vToken's CUDA-graph choice to ``vllm_config.compilation_config`` (mutates it only when the
    engine's statistics need every attention layer's Python hook and a graph would skip it; logs why).
    Returns whether requests are held to what the graphs collect: the engine keeps graphs with FULL pieces
    and no per-layer hook (a query-free policy), or scores through query buffers (``captures_queries``);
    ``refuse_under_full_graphs`` then rejects a request that would need other layers' queries.

    Every-layer statistics need each attention layer to run as Python: PIECEWISE graphs give that only when
    attention is split out of the captured pieces (``attention_outside_graphs``). With ``splitting_ops=[]``,
    an attention-fusion pass or a compilation mode that does not split, vLLM has already turned PIECEWISE
    into FULL or NONE and a PIECEWISE graph would contain attention: then no graphs (``NONE``), said in the
    log with the setting's name. A subset of the layers keeps vLLM's mode, whatever it is: the buffer copies
    are replayed by FULL and PIECEWISE graphs alike."""
    from vllm.config.compilation import CUDAGraphMode

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return False
    if not needs_attention_scores(settings):
        return mode.has_full_cudagraphs()
    reason = "scores: always" if settings.scores == "always" else f"policy {settings.cfg.policy!r}"
    if captures_queries(vllm_config, settings):
        logger.info(
            "vToken: cudagraph_mode %s kept: %s scores %d of %d attention layers, whose queries are copied "
            "into persistent buffers inside the forward (replayed by CUDA graphs) and scored after it",
            mode.name,
            reason,
            settings.cfg.score_layers,
            model_depth(vllm_config),
        )
        return True
    if attention_outside_graphs(cc):
        if mode == CUDAGraphMode.PIECEWISE:
            return False
        new, why = CUDAGraphMode.PIECEWISE, "FULL graphs do not replay it (query-free policies keep FULL)"
    else:
        new, why = CUDAGraphMode.NONE, f"no CUDA graph would run it: {_graph_split_reason(cc)}"
    logger.warning(
        "vToken: cudagraph_mode %s -> %s: %s needs attention statistics from every layer (score_layers=%s), "
        "collected after each attention layer by Python code; %s",
        mode.name,
        new.name,
        reason,
        settings.cfg.score_layers,
        why,
    )
    cc.cudagraph_mode = new
    if new == CUDAGraphMode.NONE:
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
    return False


def refuse_under_full_graphs(request_cfg, engine) -> None:
    """Raise ``ConfigError`` when a request of an engine whose graphs collect only what the engine asked for
    (``choose_cudagraph_mode`` returned True) asks for attention statistics the graphs do not collect: an
    attention policy on a query-free engine, or other ``score_layers`` than the engine's queries buffered.
    ``engine``: the engine's ``EngineSettings`` (exact: ``scores: always`` counts) or its ``VTokenConfig``
    (then only an attention policy counts as buffering queries: stricter, never wrong)."""
    if not (request_cfg.mode.evicts and request_cfg.policy_class.needs_attention()):
        return
    engine_cfg = getattr(engine, "cfg", engine)
    buffered = engine_cfg.policy_class.needs_attention() or getattr(engine, "scores", "auto") == "always"
    if not buffered:
        raise ConfigError(
            f"policy {request_cfg.policy!r} needs attention statistics, which FULL CUDA graphs do not "
            f"collect; this engine keeps them for its query-free policy {engine_cfg.policy!r}: start it with "
            "an attention policy (vToken then copies its scored layers' queries inside the graphs) or with "
            "compilation_config.cudagraph_mode=PIECEWISE"
        )
    if request_cfg.score_layers != engine_cfg.score_layers:
        raise ConfigError(
            f"score_layers={request_cfg.score_layers!r}: this engine keeps CUDA graphs and copies the queries "
            f"of its score_layers={engine_cfg.score_layers!r} layers inside them; a request cannot score other "
            "layers: drop the override, start the engine with this score_layers, or with "
            "compilation_config.cudagraph_mode=PIECEWISE"
        )


def prepare_engine(vllm_config, settings) -> bool:
    """Both choices for one engine (``settings``: its ``EngineSettings``). Returns ``choose_cudagraph_mode``'s
    answer. Side effects: may switch the config's class and change its ``compilation_config``."""
    pin_v1_model_runner(vllm_config)
    return choose_cudagraph_mode(vllm_config, settings) if settings.enabled else False
