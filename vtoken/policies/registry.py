"""Name → policy class registry. ``@register_policy("h2o")`` on each policy file's class."""

from __future__ import annotations

from typing import TypeVar

from vtoken.errors import ConfigError
from vtoken.policies.base import ScorerPolicy

P = TypeVar("P", bound=type[ScorerPolicy])


class PolicyRegistry:
    """Holds the registered policy classes; unknown names raise with the list of valid ones."""

    def __init__(self) -> None:
        self._classes: dict[str, type[ScorerPolicy]] = {}

    def register(self, name: str):
        def deco(cls: P) -> P:
            if name in self._classes:
                raise ValueError(f"policy {name!r} registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def get(self, name: str) -> type[ScorerPolicy]:
        try:
            return self._classes[name]
        except KeyError:
            raise ConfigError(f"unknown policy {name!r}; valid policies: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._classes)


REGISTRY = PolicyRegistry()
register_policy = REGISTRY.register
