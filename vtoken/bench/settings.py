"""How a ``vtoken bench …`` command turns its flags and ``--set vtoken.KEY=VALUE`` into the one ``VTokenConfig``
it runs: the bench's base config (declared once, in its module), the flags the command was given over it,
then the ``--set`` items over those (``vtoken.core.config.with_sets``, the parser of ``simulate`` and
``verify``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from vtoken.core.config import SET_PREFIX, Scope, VTokenConfig, parse_sets, with_sets
from vtoken.errors import ConfigError

BUDGET_HELP = "fraction of the context in (0, 1] or a token count (Budget.parse)"

__all__ = ["EVICTING", "configure"]

# what the engine benches' base configs derive from (each bench's ``BASE`` changes what it must): every token may
# be evicted (scope all), 20 % kept, the engine's defaults otherwise — the setting of every report they wrote
EVICTING = VTokenConfig(budget=0.2, scope=Scope.ALL)


def configure(base: VTokenConfig, sets: Iterable[str], *, own: Mapping[str, str] = {}, **flags: Any) -> VTokenConfig:
    """``base`` with the command's ``flags`` (``VTokenConfig`` keys; ``None``: not given, the base's value) and
    the ``--set vtoken.KEY=VALUE`` items over them. ``own``: the keys the bench sets itself per variant or
    cell, each with the flag that does (a ``--set`` of one is refused naming it). ``ConfigError`` names an
    unknown key (listing the valid ones), a bench's own key or a bad value."""
    sets = tuple(sets)
    taken = [key for key in parse_sets(sets) if key in own]
    if taken:
        raise ConfigError("; ".join(f"--set {SET_PREFIX}{k}: this bench sets {k} itself ({own[k]})" for k in taken))
    given = {k: v for k, v in flags.items() if v is not None}
    return with_sets(replace(base, **given) if given else base, sets)
