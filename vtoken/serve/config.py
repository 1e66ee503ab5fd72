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
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from vtoken.core.config import Budget, ConfigError, VTokenConfig
from vtoken.vllm.config import check_platform_block_size

CONFIG_ENV = "VTOKEN_SERVE_CONFIG"  # path to a YAML/JSON file, or inline JSON, read by serve_app.py


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VTokenSection(_Section):
    """Mirror of ``vtoken.core.config.VTokenConfig``; validated by building one."""

    policy: str = "h2o"
    budget: str | float | int = Field(0.5, description="fraction of the context in (0, 1], or a token count")
    mode: str = Field("repack", description="none | naive | repack | reuse+repack")
    block_size: int = 32
    sinks: int = 4
    recent: int = 16
    trigger: str = "step"
    seed: int = 0

    @model_validator(mode="after")
    def _validate_with_core(self) -> VTokenSection:
        try:
            self.to_core()
        except ConfigError as exc:  # re-raised as ValueError so pydantic reports it with its location
            raise ValueError(str(exc)) from None
        try:
            check_platform_block_size(self.block_size)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def to_core(self) -> VTokenConfig:
        """The frozen core config (raises ``ConfigError`` naming a bad value)."""
        budget = Budget.parse(self.budget)
        return VTokenConfig(
            policy=self.policy,
            budget=budget,
            mode=self.mode,
            block_size=self.block_size,
            sinks=self.sinks,
            recent=self.recent,
            trigger=self.trigger,
            seed=self.seed,
        )


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


class SloSection(_Section):
    """Service-level objectives a finished request is judged against (both must hold)."""

    ttft_ms: float = Field(2000.0, gt=0, description="time to first token, arrival → first token")
    tpot_ms: float = Field(200.0, gt=0, description="mean time per output token after the first")


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
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(10.0, ge=0)


class AutoscalingSection(_Section):
    """KV-utilization autoscaling (``vtoken.serve.autoscaling.KVAutoscalingPolicy``)."""

    enabled: bool = False
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    upscale_kv_utilization: float = Field(0.75, gt=0, le=1, description="mean kv_utilization to add replicas")
    downscale_kv_utilization: float = Field(0.25, ge=0, lt=1, description="… to remove one (hysteresis)")
    target_kv_utilization: float = Field(0.5, gt=0, le=1, description="sizing target when scaling up")
    upscale_waiting_per_replica: float = Field(2.0, gt=0, description="engine-waiting requests per replica")
    metrics_interval_s: float = Field(1.0, gt=0)
    look_back_period_s: float = Field(5.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if (
            self.initial_replicas is not None
            and not self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(f"initial_replicas {self.initial_replicas} outside [min_replicas, max_replicas]")
        if self.downscale_kv_utilization >= self.upscale_kv_utilization:
            raise ValueError(
                f"downscale_kv_utilization {self.downscale_kv_utilization} must be below "
                f"upscale_kv_utilization {self.upscale_kv_utilization} (hysteresis band)"
            )
        return self


class RouterSection(_Section):
    """KV-aware routing (``vtoken.serve.router.KVAwareRouter``); see its ``initialize_state``."""

    enabled: bool = True
    stats_period_s: float = Field(1.0, gt=0, description="how often Serve polls record_routing_stats")
    stats_timeout_s: float = Field(2.0, gt=0)
    stale_after_s: float = Field(5.0, gt=0, description="stats older than this are ignored")
    fragmentation_weight: float = Field(0.5, ge=0)
    tokens_per_queued_request: int = Field(256, ge=0)
    tie_tokens: int = Field(64, ge=0)


class MetricsSection(_Section):
    """Per-replica Prometheus endpoint: ``http://host:(port + local rank)/metrics``; port None disables."""

    host: str = "127.0.0.1"
    port: int | None = Field(9500, ge=1, le=65535)
    port_span: int = Field(8, ge=1, description="ports tried after base+local_rank if busy")


class ServeAppConfig(_Section):
    """Everything needed to build the vToken Serve application. See docs/serving.md for each key."""

    model: str = Field("default", description="'default' (SmolLM2-135M), 'tiny-llama', a path or HF id")
    served_model_name: str | None = None
    app_name: str = "vtoken"
    route_prefix: str = "/"
    vtoken: VTokenSection = Field(default_factory=VTokenSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    slo: SloSection = Field(default_factory=SloSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    deployment: DeploymentSection = Field(default_factory=DeploymentSection)
    autoscaling: AutoscalingSection = Field(default_factory=AutoscalingSection)
    router: RouterSection = Field(default_factory=RouterSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> ServeAppConfig:
        if self.limits.max_tokens >= self.engine.max_model_len:
            raise ValueError(
                f"limits.max_tokens {self.limits.max_tokens} must be below "
                f"engine.max_model_len {self.engine.max_model_len}"
            )
        blocks = self.engine.kv_cache_blocks
        if blocks is not None and (blocks - 1) * self.vtoken.block_size < self.engine.max_model_len:
            raise ValueError(
                f"engine.kv_cache_blocks {blocks} hold {(blocks - 1) * self.vtoken.block_size} tokens "
                f"(one block is vLLM's null block), less than max_model_len {self.engine.max_model_len}"
            )
        return self

    @property
    def core(self) -> VTokenConfig:
        return self.vtoken.to_core()

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
