"""Frozen configuration of vToken: reclamation mode, budget, protection, trigger, eviction granularity.

Everything here is validated on construction and names the bad value in its error, so a typo in a
CLI flag or in vLLM's ``--additional-config`` fails at start-up, not mid-request.
"""

from __future__ import annotations

import contextlib
import functools
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from vtoken.errors import ConfigError
from vtoken.policies import get_policy_class, make_policy
from vtoken.policies.context import Stat

__all__ = [
    "Budget",
    "Granularity",
    "Mode",
    "PromptScores",
    "Scope",
    "Trigger",
    "VTokenConfig",
    "check_block_size",
    "parse_sets",
    "reject_unknown",
    "score_layer_indices",
    "with_sets",
]


def _edge_schema(parse: Callable[[Any], Any], dump: Callable[[Any], Any], values: tuple[str, ...] = ()) -> Any:
    """Pydantic core schema for a value the edge (pydantic) validates with our own ``parse`` and dumps
    with ``dump``, so messages stay ours; ``values``: the valid strings (else a number or a string).
    Called only by pydantic (imported here, never at import time)."""
    from pydantic_core import core_schema as cs

    shown = cs.literal_schema(list(values)) if values else cs.union_schema([cs.float_schema(), cs.str_schema()])
    return cs.no_info_plain_validator_function(
        parse, serialization=cs.plain_serializer_function_ser_schema(dump), json_schema_input_schema=shown
    )


def _parse_member(cls: type[StrEnum], value: object, what: str, plural: str):
    """``cls(value)``, or ``ConfigError`` naming the bad value and the valid ones."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value))
    except ValueError:
        valid = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown {what} {value!r}; valid {plural}: {valid}") from None


class _Choice(StrEnum):
    """A setting with a fixed set of values: ``parse`` returns the member or raises ``ConfigError`` naming the
    bad value and the valid ones (``_names``: what the setting is called, singular and plural); pydantic
    validates it with ``parse`` at the edge."""

    @classmethod
    def _names(cls) -> tuple[str, str]:  # pragma: no cover - every setting names itself
        raise NotImplementedError

    @classmethod
    def parse(cls, value):
        return _parse_member(cls, value, *cls._names())

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return _edge_schema(cls.parse, str, tuple(m.value for m in cls))


class Mode(_Choice):
    """Reclamation mode (docs/architecture.md §3). One mechanism, four accountings.

    ``none``          no eviction at all, vanilla paging: a request holds ceil(seen/B) blocks.
    ``naive``         paired baseline: same victims as ``repack``; a block returns to the pool only when
                      every token originally placed in it is dead.
    ``repack``        vToken: holes below ``live`` are filled from the tail; a request holds ceil(live/B).
    ``reuse+repack``  new tokens are written into holes first (zero copies), the tail fills the rest.
    """

    NONE = "none"
    NAIVE = "naive"
    REPACK = "repack"
    REUSE_REPACK = "reuse+repack"

    @property
    def evicts(self) -> bool:
        return self is not Mode.NONE

    @property
    def reuses_holes(self) -> bool:
        return self is Mode.REUSE_REPACK

    @classmethod
    def _names(cls) -> tuple[str, str]:
        return "reclamation mode", "modes"


class Trigger(_Choice):
    """When eviction (and so a repack) runs.

    ``step``   every step in which the request is over budget (one small plan per step).
    ``block``  only when the request is at least one block over budget; it then evicts down to the
               budget, so every plan frees whole blocks and moves are batched.
    ``pressure`` only when vLLM's KV pool is short (``vtoken.core.batch.pressure``): nothing is evicted while the
               free blocks cover the running batch's next step; when they do not (vLLM would preempt, or the
               head of the queue cannot get its first chunk), the batch's evictable tokens go in one policy
               order across the requests, none below its ``budget`` (a floor), until the step fits plus a
               margin of one block per running request (the hysteresis); vLLM preempts only once every
               request is at its floor.
    """

    STEP = "step"
    BLOCK = "block"
    PRESSURE = "pressure"

    @classmethod
    def _names(cls) -> tuple[str, str]:
        return "repack trigger", "triggers"


class Granularity(_Choice):
    """What one eviction removes.

    ``token``  single tokens, the policy's lowest scores (vToken).
    ``block``  whole original blocks (logical ``b·B .. b·B+B-1``) whose tokens are all live and evictable,
               lowest mean score first, ``⌈over/B⌉`` of them (so up to B − 1 below the budget): the
               block-level baseline (e.g. OpenVINO GenAI's cache eviction). Its ``naive`` mode frees each
               evicted block outright, so naive is within a block or two of the packing bound.
    """

    TOKEN = "token"
    BLOCK = "block"

    @classmethod
    def _names(cls) -> tuple[str, str]:
        return "eviction granularity", "granularities"


class Scope(_Choice):
    """Which tokens eviction may remove (the protected ones — sinks, recent window, prompt tail, shared
    prefix blocks — never).

    ``all``        prompt and generated tokens alike; the budget counts every token seen.
    ``generated``  decode-only eviction: the prompt is kept whole (so its blocks stay prefix-cacheable and
                   the question is never lost), only tokens generated after it are candidates, and the
                   budget counts generated tokens — a request keeps its prompt plus ``budget`` of its output.
    """

    ALL = "all"
    GENERATED = "generated"

    @classmethod
    def _names(cls) -> tuple[str, str]:
        return "eviction scope", "scopes"


class PromptScores(_Choice):
    """Which of the prompt's queries score its tokens in H2O's accumulated attention — the one statistic that
    sums *every* query (TOVA reads the last query, Scissorhands the last 64, SnapKV the window already).

    ``all``     every query of the prompt (H2O's definition).
    ``window``  question-aware: when the step that computes the prompt's last token has run, a prompt token's
                accumulated attention becomes that of the prompt's last ``OBSERVATION_WINDOW`` queries
                (SnapKV's observation window, where tasks put the question); generated tokens' queries add
                to it as usual. A recompute after a preemption starts the table afresh, so again from the
                window.
    """

    ALL = "all"
    WINDOW = "window"

    @classmethod
    def _names(cls) -> tuple[str, str]:
        return "prompt_scores setting", "values"


@dataclass(frozen=True)
class Budget:
    """How many tokens a request may keep: a fixed count, or a fraction of the context seen so far.

    A fraction ``f`` keeps ``ceil(f * seen)`` tokens at every step (H2O's definition: the budget grows
    with the sequence). Protected tokens (sinks, recent window, shared prefix blocks) are never evicted,
    so a request may stay above a budget smaller than its protected set.
    """

    count: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.fraction is None):
            raise ConfigError("budget needs exactly one of a token count or a fraction")
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ConfigError(f"budget count must be a positive integer, got {self.count!r}")
        if self.fraction is not None and not (0.0 < self.fraction <= 1.0 and math.isfinite(self.fraction)):
            raise ConfigError(f"budget fraction must be in (0, 1], got {self.fraction!r}")

    @classmethod
    def parse(cls, value: str | float | int | Budget) -> Budget:
        """``"0.2"``/``0.2`` → 20% of the context; ``"512"``/``512`` → 512 tokens."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"invalid budget {value!r}: give a fraction in (0, 1] or a token count")
        if isinstance(value, int):
            return cls(count=value)
        if isinstance(value, float):
            return cls(fraction=value)
        text = str(value).strip()
        try:
            return cls(count=int(text)) if text.lstrip("+-").isdigit() else cls(fraction=float(text))
        except ValueError:  # also ConfigError from the range checks
            raise ConfigError(
                f"invalid budget {value!r}: give a fraction in (0, 1] (e.g. 0.2) or a positive token count (e.g. 512)"
            ) from None

    def tokens(self, seen: int) -> int:
        """Tokens a request that has seen ``seen`` tokens may keep (never more than ``seen``)."""
        if self.count is not None:
            return min(self.count, seen)
        fraction = self.fraction if self.fraction is not None else 1.0  # exactly one is set (__post_init__)
        return min(seen, math.ceil(fraction * seen - 1e-9))

    def __str__(self) -> str:
        return str(self.count) if self.count is not None else f"{self.fraction:g}"

    def to_json(self) -> int | float:
        """The token count or the fraction, as written in a config (``parse`` reads it back)."""
        if self.count is not None:
            return self.count
        return self.fraction if self.fraction is not None else 1.0  # exactly one is set (__post_init__)

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return _edge_schema(cls.parse, cls.to_json)


def _attention_mass_policies() -> str:
    """The registered policies whose scores are attention mass (``keep_mass`` and ``score_pool`` need one)."""
    from vtoken.policies import policy_names

    return ", ".join(n for n in policy_names() if get_policy_class(n).attention_mass)


DEFAULT_SCORE_LAYERS = 1  # attention layers that score by default (VTokenConfig.score_layers; measured there)


@dataclass(frozen=True)
class VTokenConfig:
    """Static vToken settings for one engine (one block size, one policy, one mode).

    This is the one declaration of the settings: vLLM's ``additional_config["vtoken"]`` keys and
    per-request overrides (``vtoken.vllm.config``), the serving config's ``vtoken:`` section (pydantic
    validates this dataclass directly) and the simulator's settings are its fields. Each field's default is
    declared here and its documentation is the string right under it; ``vtoken settings`` renders both as
    the settings table of docs/vllm-integration.md and docs/serving.md (``vtoken.core.settings_doc``).

    Nothing is evicted unless a request or the engine asks for it (``budget`` 1.0), and a request that
    cannot evict (``can_evict``) collects no statistics, so its steps are vLLM's own.
    """

    __pydantic_config__ = {"extra": "forbid"}  # read by pydantic only (the serving config's edge)

    policy: str = "h2o"
    """Eviction policy: a registered policy name (`vtoken policies` lists them)."""
    budget: Budget = Budget(fraction=1.0)
    """Tokens a request may keep: a fraction of the context in (0, 1] (`0.2`) or a token count (`512`); with
    `scope: generated`, of the generated tokens. The default, `1.0`, evicts nothing: under the rule of
    docs/quality.md ("The parity rule") only a setting that saves ≈ 3 % of the blocks (decode-only 95 %) is at
    parity, so eviction is opt-in and vToken never trades a user's quality silently."""
    mode: Mode = Mode.REPACK
    """Reclamation mode (`Mode`, docs/architecture.md §3): `none` (no eviction: vanilla vLLM), `naive` (the
    paired baseline: a block returns to the pool only when every token placed in it is dead), `repack`
    (holes are filled from the tail: a request holds ⌈live/B⌉ blocks) or `reuse+repack` (new tokens are
    written into holes first)."""
    block_size: int = 32
    """Tokens per KV block: a power of two (a multiple of 32 on vLLM's CPU backend). In vLLM's
    `additional_config` it must equal vLLM's `--block-size` if given."""
    sinks: int = 4
    """The first `sinks` logical tokens are never evicted (attention sinks)."""
    recent: int = 16
    """The last `recent` logical tokens are never evicted (recent window)."""
    prompt_tail: int = 0
    """The prompt's last `prompt_tail` tokens are never evicted (where a task puts its question or
    instruction); they count in the budget like any live token."""
    scope: Scope = Scope.GENERATED
    """Which tokens eviction may remove (`Scope`): `all` (prompt and generated tokens are candidates; the
    budget counts every token seen) or `generated` (decode-only eviction: the prompt is kept whole, so its
    blocks stay prefix-cacheable and the question is never lost, and the budget counts generated tokens
    only: a request keeps its prompt plus `budget` of its output)."""
    prompt_scores: PromptScores = PromptScores.ALL
    """Which prompt queries score the prompt in H2O's accumulated attention (`PromptScores`): `all` (every
    query, H2O's definition) or `window` (question-aware: once the prompt's last token is computed, a prompt
    token's score is the attention of the prompt's last 32 queries, SnapKV's observation window, where tasks
    put the question; generated tokens' queries add as usual). TOVA (last query), Scissorhands (last 64) and
    SnapKV (the window) read only late queries already."""
    trigger: Trigger = Trigger.STEP
    """When eviction runs (`Trigger`): `step` (every step over budget), `block` (only when at least one
    block over budget, then down to the budget: every plan frees whole blocks, moves are batched) or
    `pressure` (only when vLLM's pool cannot hold the running batch's next step or the queue head's first
    chunk: tokens then go in policy order across the batch, none below `budget`, which becomes a floor,
    until the step fits plus one block per running request, the hysteresis margin; vLLM preempts only once
    every request is at its floor; one KV cache group, one rank, synchronous scheduling, token granularity,
    no `keep_mass`; docs/vllm-integration.md, "Evicting under pressure")."""
    granularity: Granularity = Granularity.TOKEN
    """What one eviction removes (`Granularity`): `token` (single tokens, the policy's lowest scores) or
    `block` (whole original blocks whose tokens are all live and evictable, lowest mean score first,
    ⌈over/B⌉ of them: the block-level baseline; docs/core.md)."""
    seed: int = 0
    """Seed of the `random` policy."""
    score_layers: int | None = DEFAULT_SCORE_LAYERS
    """Attention layers whose q·K feeds the attention statistics (H2O, TOVA, Scissorhands, SnapKV): `null` =
    every layer, `n` = `n` layers spread evenly back from the last (`score_layer_indices`: depth − 1 −
    ⌊j·depth/n⌋); `n` ≥ depth = every layer. Unscored layers cost nothing; the statistics are the mean over
    the scored layers; key norms (KNorm) always use every layer. The default, 1 (the last layer), costs
    1.01–1.06× a repack decode step instead of 1.59–1.78× for every layer at the same measured quality
    (docs/quality.md, "Scoring a subset of layers")."""
    keep_mass: float | None = None
    """The adaptive budget τ (`null`: off): each step also evicts the lowest-scored evictable tokens while the
    kept evictable ones hold ≥ τ of their attention mass (`ScorerPolicy.mass_evictions`; policies whose
    scores are attention mass, token granularity), so a request whose attention is concentrated keeps few
    tokens and a diffuse one many; `budget` stays an upper bound (`1.0`: the mass alone decides)."""
    score_pool: int = 0
    """Span pooling (`0`: off): selection ranks a token by the highest score among the live tokens within
    this logical distance (`ScorerPolicy.pool`, SnapKV's max pooling for every attention-mass policy), so a
    value spread over several tokens (a number's digits) is kept or evicted whole; not with `keep_mass`
    (pooled scores do not add up)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "trigger", Trigger.parse(self.trigger))
        object.__setattr__(self, "scope", Scope.parse(self.scope))
        object.__setattr__(self, "prompt_scores", PromptScores.parse(self.prompt_scores))
        object.__setattr__(self, "granularity", Granularity.parse(self.granularity))
        check_block_size(self.block_size)
        for name in ("sinks", "recent", "prompt_tail", "seed", "score_pool"):
            check_non_negative(name, getattr(self, name))
        n = self.score_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(
                f"score_layers must be a positive integer (layers scored) or null (every layer), got {n!r}"
            )
        cls = get_policy_class(self.policy)
        if self.trigger is Trigger.PRESSURE and (self.keep_mass is not None or self.granularity is Granularity.BLOCK):
            raise ConfigError(
                "trigger 'pressure' evicts single tokens down to at most the budget's floor; "
                "it does not combine with keep_mass or granularity 'block'"
            )
        self._check_keep_mass(cls)
        self._check_score_pool(cls)

    def _check_keep_mass(self, cls) -> None:
        m = self.keep_mass
        if m is None:
            return
        if isinstance(m, str):  # the OpenAI API's vllm_xargs and CLI values may carry it as text
            with contextlib.suppress(ValueError):
                m = float(m)
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 < m < 1.0:
            raise ConfigError(f"keep_mass must be a fraction in (0, 1) (attention mass kept) or null, got {m!r}")
        object.__setattr__(self, "keep_mass", float(m))
        if not cls.attention_mass:
            raise ConfigError(
                f"keep_mass needs a policy that scores attention mass, not {self.policy!r}; "
                f"valid: {_attention_mass_policies()}"
            )
        if self.granularity is Granularity.BLOCK:
            raise ConfigError("keep_mass evicts single tokens; it does not combine with granularity 'block'")

    def _check_score_pool(self, cls) -> None:
        if not self.score_pool:
            return
        if not cls.attention_mass:
            raise ConfigError(
                f"score_pool pools attention scores; policy {self.policy!r} has none; "
                f"valid: {_attention_mass_policies()}"
            )
        if self.keep_mass is not None:
            raise ConfigError(
                "score_pool does not combine with keep_mass (pooled scores do not add up to a mass); set one of them"
            )

    @property
    def question_aware(self) -> bool:
        """Whether the window replaces the prompt's accumulated attention (``prompt_scores: window`` with a
        policy that reads ``accumulated``)."""
        return self.prompt_scores is PromptScores.WINDOW and Stat.ACCUMULATED in self.policy_class.needs

    def measured_stats(self) -> frozenset[Stat]:
        """The statistics an engine must measure: the policy's ``needs``, plus the observation window when
        ``question_aware`` (it becomes the prompt's ``accumulated``)."""
        needs = self.policy_class.needs
        return needs | {Stat.WINDOW} if self.question_aware else needs

    @property
    def can_evict(self) -> bool:
        """Whether a request with this setting may ever lose a token: an evicting mode, and a budget below the
        whole context or an adaptive ``keep_mass`` (a fraction of 1.0 without it keeps every token, so no
        statistic is worth collecting for it). Pure."""
        return self.mode.evicts and (self.keep_mass is not None or self.budget.fraction != 1.0)

    def kept_prompt(self, prompt_len: int) -> tuple[int, int]:
        """Logical range ``[lo, hi)`` of the prompt never evicted for a request whose prompt has
        ``prompt_len`` tokens: all of it with scope ``generated``, else its last ``prompt_tail``. Pure."""
        if self.scope is Scope.GENERATED:
            return 0, prompt_len
        return max(prompt_len - self.prompt_tail, 0), prompt_len

    def kept_live(self, seen: int, prompt_len: int) -> int:
        """Tokens a request that has seen ``seen`` (``prompt_len`` of them its prompt) may keep live: the
        budget of what it has seen, or with scope ``generated`` its prompt plus the budget of its output."""
        if self.scope is Scope.GENERATED:
            prompt = min(prompt_len, seen)
            return prompt + self.budget.tokens(seen - prompt)
        return self.budget.tokens(seen)

    def make_policy(self):
        """A fresh policy instance for this config (policies are frozen dataclasses)."""
        return make_policy(self.policy, seed=self.seed, pool=self.score_pool)

    @property
    def policy_class(self):
        return get_policy_class(self.policy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able ``{field: value}`` (budget as its number, enums as strings); ``from_dict`` inverts it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["budget"] = self.budget.to_json()
        for name in ("mode", "trigger", "granularity", "scope", "prompt_scores"):
            out[name] = out[name].value
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "vtoken") -> VTokenConfig:
        """Build from a mapping of field names; raises ``ConfigError`` naming an unknown key or bad value."""
        reject_unknown(raw, cls.keys(), where)
        return cls(**raw)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The setting names, in declaration order."""
        return tuple(f.name for f in fields(cls))


SET_PREFIX = "vtoken."  # ``--set vtoken.KEY=VALUE``: the serving config's spelling of a VTokenConfig key
SET_HELP = "vtoken.KEY=VALUE: any setting of `vtoken settings`, over the command's flags (repeatable)"


def _typed(name: str, text: str) -> Any:
    """``text`` as the type of ``VTokenConfig.name``: ``null``/``none`` for an optional field, an integer for an
    ``int`` field, a number for a ``float`` one, else the text (budgets and choices parse their own text)."""
    hint = _hints()[name]
    args = set(typing.get_args(hint)) or {hint}
    if type(None) in args and text.lower() in ("null", "none"):
        return None
    if int in args:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(
                f"{name} must be an integer{' or null' if type(None) in args else ''}, got {text!r}"
            ) from None
    if float in args:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(
                f"{name} must be a number{' or null' if type(None) in args else ''}, got {text!r}"
            ) from None
    return text


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(VTokenConfig)


def parse_sets(items: Iterable[str]) -> dict[str, Any]:
    """``{key: value}`` from ``--set vtoken.KEY=VALUE`` items (repeatable; a later item wins), each value typed
    as its field (``_typed``). ``ConfigError`` names a malformed item or an unknown key (listing the valid
    ones); the values themselves are checked when a config is built (``with_sets``)."""
    out: dict[str, Any] = {}
    valid = ", ".join(SET_PREFIX + k for k in VTokenConfig.keys())
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.startswith(SET_PREFIX):
            raise ConfigError(f"--set {item!r}: expected vtoken.KEY=VALUE; valid keys: {valid}")
        name = key.removeprefix(SET_PREFIX)
        if name not in VTokenConfig.keys():
            raise ConfigError(f"--set {item!r}: unknown key {key!r}; valid keys: {valid}")
        try:
            out[name] = _typed(name, value.strip())
        except ConfigError as err:
            raise ConfigError(f"--set {item!r}: {err}") from None
    return out


def with_sets(base: VTokenConfig, items: Iterable[str]) -> VTokenConfig:
    """``base`` with the ``--set vtoken.KEY=VALUE`` overrides applied (``dataclasses.replace``, so every value is
    validated as on construction); ``ConfigError`` names the bad item, key or value."""
    over = parse_sets(items)
    if not over:
        return base
    try:
        return replace(base, **over)
    except ConfigError as err:
        shown = " ".join(f"{SET_PREFIX}{k}={v}" for k, v in over.items())
        raise ConfigError(f"--set {shown}: {err}") from None


def reject_unknown(given: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    """Raise ``ConfigError`` listing the unknown keys of ``given`` and the valid ones."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown {where} setting(s) {', '.join(map(repr, unknown))}; valid settings: {', '.join(valid)}"
        )


def score_layer_indices(count: int | None, depth: int) -> tuple[int, ...]:
    """The attention layers (0-based, in forward order) that score when ``count`` of ``depth`` do: every
    ``depth/count``-th layer counted back from the last, ``depth - 1 - floor(j·depth/count)`` for
    ``j = 0..count-1``, ascending. ``None`` or ``count >= depth``: every layer; ``1``: the last. Pure."""
    if depth < 1:
        raise ValueError(f"depth must be positive, got {depth}")
    if count is None or count >= depth:
        return tuple(range(depth))
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    return tuple(sorted(depth - 1 - (j * depth) // count for j in range(count)))


def check_non_negative(name: str, value: object, what: str = "integer") -> None:
    """``ConfigError`` ``"{name} must be a non-negative {what}, got {value!r}"`` unless ``value`` is an int ≥ 0
    (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative {what}, got {value!r}")


def check_block_size(block_size: object) -> int:
    """Block sizes are positive powers of two (vLLM's CPU backend further needs a multiple of 32)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
    if block_size & (block_size - 1):
        raise ConfigError(f"block size must be a power of two, got {block_size}")
    return block_size
