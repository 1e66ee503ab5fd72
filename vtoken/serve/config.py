"""The serving configuration: one pydantic model for ``serve run``, ``serve build`` and ``vtoken serve``.

This is an *edge* model (it parses YAML/JSON/CLI input), so it is pydantic; everything below the edge
uses the frozen dataclasses of ``vtoken.core.config``. vToken settings are validated by constructing a
``VTokenConfig`` — the rules live there, not here — so a bad policy, budget, mode or block size fails
when the application is *built*, with the core's message naming the value::

    >>> ServeAppConfig.model_validate({"vtoken": {"policy": "lru"}})
    ValidationError: ... unknown policy 'lru'; valid policies: h2o, ...

Sections: ``model``, ``vtoken``, ``engine``, ``slo``, ``limits``, ``deployment``, ``autoscaling``,
``router``, ``metrics``. Unknown keys are rejected everywhere (a typo must not be ignored silently).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from vtoken.core.config import VTokenConfig
from vtoken.errors import ConfigError
from vtoken.serve.control.autoscaling import ScalingParams
from vtoken.serve.control.ranking import RouterParams
from vtoken.vllm.config import check_platform_block_size
from vtoken.vllm.scheduling.pool_need import FULL, PoolShape

CONFIG_ENV = "VTOKEN_SERVE_CONFIG"  # path to a YAML/JSON file, or inline JSON, read by serve_app.py


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSection(_Section):
    """vLLM engine knobs. ``kv_cache_blocks`` fixes the KV pool exactly (tests use tiny pools)."""

    kv_cache_blocks: int | None = Field(None, ge=2, description="exact KV pool size in blocks")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV pool memory when kv_cache_blocks is unset")
    max_model_len: int = Field(2048, ge=16)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    dtype: str = "float32"
    enforce_eager: bool = True
    enable_prefix_caching: bool | None = None
    threads_per_replica: int | None = Field(
        None, ge=1, description="CPU cores each replica's worker binds (VLLM_CPU_OMP_THREADS_BIND by rank)"
    )
    cpu_offset: int = Field(0, ge=0, description="first core used for the per-rank binding")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="TP ranks per replica: the replica reserves one placement-group bundle per rank"
    )
    kv_cache_dtype: str = Field("auto", description="vLLM's kv_cache_dtype; vToken refuses quantized caches")


class SloSection(_Section):
    """Service-level objectives a finished request is judged against (both must hold)."""

    ttft_ms: float = Field(2000.0, gt=0, description="time to first token, arrival → first token")
    tpot_ms: float = Field(200.0, gt=0, description="mean time per output token after the first")
    admission: bool = Field(
        False,
        description="SLO-aware admission: the engine admits only as many running requests as meet "
        "tpot_ms given measured step times (the engine's admission_tpot_ms; never preempts)",
    )


class LimitsSection(_Section):
    """Request limits enforced by the replica before vLLM sees the request (and API key)."""

    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_tokens: int = Field(1024, ge=1, description="max_tokens / max_completion_tokens ceiling")
    max_n: int = Field(4, ge=1)
    max_prompt_chars: int = Field(65536, ge=1, description="characters in prompt or all messages")
    api_key: SecretStr | None = Field(None, description="prefer api_key_env; a key here lands in YAML")
    api_key_env: str | None = Field("VTOKEN_API_KEY", description="env var read in the replica for the key")

    def resolved_api_key(self, environ: dict[str, str] | None = None) -> str | None:
        """The key to require, or None (no auth). Pure: reads ``environ`` (default ``os.environ``)."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return self.api_key.get_secret_value()
        env = os.environ if environ is None else environ
        value = env.get(self.api_key_env, "") if self.api_key_env else ""
        return value or None


class DeploymentSection(_Section):
    """Ray Serve deployment options of the replica (fixed size unless ``autoscaling.enabled``)."""

    name: str = "VTokenReplica"
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, gt=0, description="Ray CPUs reserved per replica (engine not counted)")
    max_ongoing_requests: int = Field(32, ge=1)
    max_queued_requests: int = Field(256, ge=-1, description="per handle; beyond → 503 (-1: unbounded)")
    max_replicas_per_node: int | None = Field(
        None, ge=1, le=100, description="Serve's max_replicas_per_node: 1 puts every replica on its own node"
    )
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(10.0, ge=0)
    gpus_per_rank: float = Field(
        0.0, ge=0, description="GPUs each TP rank reserves (0 on CPU; the KubeRay manifests set 1)"
    )


@dataclass(frozen=True)
class AutoscalingSettings(ScalingParams):
    """KV-utilization autoscaling: the policy's thresholds (``ScalingParams``, declared there) plus
    Serve's ``AutoscalingConfig`` options. ``enabled`` switches from a fixed ``deployment.num_replicas``."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 2
    initial_replicas: int | None = None
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, 1, "min_replicas", "max_replicas")
        _positive(self, "metrics_interval_s", "look_back_period_s")
        _at_least(self, 0, "upscale_delay_s", "downscale_delay_s")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas {self.initial_replicas} outside [min_replicas, max_replicas]")

    @property
    def params(self) -> ScalingParams:
        return ScalingParams(**ScalingParams.kwargs(self))

    def serve_options(self) -> dict[str, Any]:
        """The fields Ray Serve's ``AutoscalingConfig`` takes by the same names (all but the policy's
        thresholds and ``enabled``)."""
        own = {f.name for f in fields(AutoscalingSettings)} - {f.name for f in fields(ScalingParams)}
        return {name: getattr(self, name) for name in sorted(own - {"enabled"})}


@dataclass(frozen=True)
class RouterSettings(RouterParams):
    """KV-aware routing: the router's hyperparameters (``RouterParams``, declared there) plus how Serve
    feeds it (``stats_period_s``: how often it polls ``record_routing_stats``; ``stats_timeout_s``)."""

    enabled: bool = True
    stats_period_s: float = 1.0
    stats_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "stats_period_s", "stats_timeout_s")

    @property
    def params(self) -> RouterParams:
        return RouterParams(**RouterParams.kwargs(self))


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(obj, name)!r}")


def _at_least(obj: Any, low: int, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) >= low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(obj, name)!r}")


class MetricsSection(_Section):
    """Per-replica Prometheus endpoint: ``http://host:(port + local rank)/metrics``; port None disables.

    ``discovery``: each replica registers its endpoint with one registry actor on the Ray head, which
    keeps a Prometheus ``file_sd`` JSON of every live replica at ``sd_file`` (default: next to Ray's own
    ``prom_metrics_service_discovery.json`` in the head's Ray temp dir); docs/operations.md."""

    host: str = "127.0.0.1"
    port: int | None = Field(9500, ge=1, le=65535)
    port_span: int = Field(8, ge=1, description="ports tried after base+local_rank if busy")
    port_wait_s: float = Field(10.0, ge=0, description="how long a busy preferred port is retried first")
    discovery: bool = Field(True, description="keep the replicas' endpoints in a file_sd JSON on the head")
    sd_file: str | None = Field(None, description="file_sd path on the head (default: Ray's temp dir)")


class ServeAppConfig(_Section):
    """Everything needed to build the vToken Serve application. See docs/serving.md for each key."""

    model: str = Field("default", description="'default' (SmolLM2-135M), 'tiny-llama', a path or HF id")
    served_model_name: str | None = None
    app_name: str = "vtoken"
    route_prefix: str = "/"
    vtoken: VTokenConfig = Field(default_factory=VTokenConfig)
    engine: EngineSection = Field(default_factory=EngineSection)
    slo: SloSection = Field(default_factory=SloSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    deployment: DeploymentSection = Field(default_factory=DeploymentSection)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> ServeAppConfig:
        try:
            check_platform_block_size(self.vtoken.block_size)
        except ConfigError as exc:  # as ValueError, so pydantic reports it like every other bad value
            raise ValueError(str(exc)) from None
        if self.limits.max_tokens >= self.engine.max_model_len:
            raise ValueError(
                f"limits.max_tokens {self.limits.max_tokens} must be below "
                f"engine.max_model_len {self.engine.max_model_len}"
            )
        blocks = self.engine.kv_cache_blocks
        # the need of a model's one full-attention group, known without reading the model; a hybrid model's
        # other groups are checked at start-up (vtoken.serve.replica.engine.preflight)
        one_group = PoolShape(windows=(FULL,), block_size=self.vtoken.block_size, in_flight_tokens=0)
        if blocks is not None and blocks < one_group.need(self.engine.max_model_len):
            raise ValueError(
                f"engine.kv_cache_blocks {blocks} hold {(blocks - 1) * self.vtoken.block_size} tokens "
                f"(one block is vLLM's null block), less than max_model_len {self.engine.max_model_len}"
            )
        return self

    @property
    def model_name(self) -> str:
        """The name clients put in ``"model"``: ``served_model_name``, else the default model's name for
        'default'/'smollm2', the directory name for a path, the spec itself otherwise."""
        from vtoken.models.default import DEFAULT_ALIASES, DEFAULT_MODEL_DIRNAME

        if self.served_model_name:
            return self.served_model_name
        if self.model in DEFAULT_ALIASES:
            return DEFAULT_MODEL_DIRNAME
        return Path(self.model).name if "/" in self.model and Path(self.model).is_absolute() else self.model

    def merged(self, overrides: Mapping[str, Any] | None = None, **dotted: Any) -> ServeAppConfig:
        """A copy with ``overrides`` deep-merged and re-validated (pure). Keys may be nested dicts
        (``{"vtoken": {"mode": "none"}}``, as in a Serve YAML's ``args:``) or dotted
        (``"vtoken.mode": "none"``, as ``serve run serve_app:build vtoken.mode=none`` passes them)."""
        data = _reveal_secrets(self.model_dump(mode="python", exclude_unset=False))
        for key, value in {**(overrides or {}), **dotted}.items():
            node = data
            *parents, leaf = str(key).split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(f"cannot set {key!r}: {part!r} is not a section")
            if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
                node[leaf] = _deep_merge(node[leaf], value)
            else:
                node[leaf] = value
        return ServeAppConfig.model_validate(data)

    @classmethod
    def load(cls, source: str | os.PathLike | None = None) -> ServeAppConfig:
        """From a YAML/JSON file path, an inline JSON object, or ``$VTOKEN_SERVE_CONFIG`` (default config
        when neither is given). Raises pydantic ``ValidationError`` naming the bad key."""
        source = source if source is not None else os.environ.get(CONFIG_ENV)
        if source is None or str(source).strip() == "":
            return cls()
        text = str(source).strip()
        if text.startswith("{"):
            return cls.model_validate(json.loads(text))
        path = Path(text).expanduser()
        raw = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return cls.model_validate(yaml.safe_load(raw) or {})
        return cls.model_validate(json.loads(raw))


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _reveal_secrets(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _reveal_secrets(v) for k, v in data.items()}
    if isinstance(data, SecretStr):
        return data.get_secret_value()
    return data
