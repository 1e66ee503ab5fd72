"""Ray Serve entry point of vToken: OpenAI-compatible vLLM replicas with vToken, a KV-aware router and
KV-utilization autoscaling (docs/serving.md).

    serve run serve_app:app                      # config: $VTOKEN_SERVE_CONFIG (file or JSON) or defaults
    serve run serve_app:build vtoken.mode=none model=tiny-llama    # builder: dotted overrides
    serve build serve_app:app -o deploy/serve_config.yaml          # serve deploy / KubeRay serveConfigV2
    vtoken serve                                   # local start on 127.0.0.1 (make serve)

A Serve config YAML may point at ``serve_app:build`` and carry the ServeAppConfig under ``args:``.
"""

from __future__ import annotations

from typing import Any

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.launch.app import build_app


def build(args: dict[str, Any] | None = None):
    """Serve application builder: ``args`` (nested or dotted keys) override ``ServeAppConfig.load()``."""
    return build_app(ServeAppConfig.load().merged(args or {}))


app = build_app(ServeAppConfig.load())
