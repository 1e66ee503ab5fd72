"""The errors every layer raises, in one leaf module (imports nothing from vToken).

``ConfigError``: a setting has an invalid value (raised at start-up / build time, never mid-request).
``IntegrityError``: a token-table or block invariant of docs/architecture.md §4 is broken.
"""

from __future__ import annotations

# How every start-up refusal of an engine configuration begins (vtoken/vllm/supported_configs.py writes it; the serving
# launcher finds it in Serve's status messages to report the reason).
REFUSAL_PREFIX = "vToken cannot run this engine"


class ConfigError(ValueError):
    """A vToken setting has an invalid value; the message names the setting and the value."""


class IntegrityError(AssertionError):
    """An invariant of docs/architecture.md §4 is broken; ``invariant`` names it."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"invariant '{invariant}' broken: {detail}")
        self.invariant = invariant
