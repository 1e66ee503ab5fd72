"""The checked-in Serve config (deploy/serve_config.yaml): ``serve build`` output, named and annotated.

``serve build serve_app:app`` writes the deployment options the code attaches (router, autoscaling,
resources) but names the application ``app1`` and knows nothing about the environment the replicas and
the proxy need. ``serve_build_yaml`` runs ``serve build`` (the CLI, so the output is exactly Ray's) with
``$VTOKEN_SERVE_CONFIG`` set to the given config, then sets the application name/route prefix and the
replicas' ``runtime_env.env_vars``. The same YAML is KubeRay's ``spec.serveConfigV2``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vtoken.serve.config import CONFIG_ENV, ServeAppConfig

REPLICA_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
HEADER = """\
# vToken Serve config: `serve deploy deploy/serve_config.yaml`, or KubeRay RayService spec.serveConfigV2.
# Regenerate: vtoken serve [--config FILE] build-config -o deploy/serve_config.yaml   (docs/serving.md)
# The ServeAppConfig itself travels as VTOKEN_SERVE_CONFIG (JSON) in runtime_env; deployment options
# below override what the code sets. Set on every Ray node (head/worker container env), before Serve
# starts: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vtoken.serve.control.failover:proxy_middlewares
"""


def serve_build_yaml(cfg: ServeAppConfig, repo_root: Path | None = None) -> str:
    """The annotated Serve config YAML for ``cfg`` (runs ``serve build`` in a subprocess)."""
    import yaml

    root = repo_root or Path(__file__).resolve().parents[3]
    cfg_json = cfg.model_dump_json(exclude_defaults=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.yaml"
        env = {**os.environ, CONFIG_ENV: cfg_json, "RAY_AUTH_MODE": "disabled"}
        serve_cli = Path(sys.executable).with_name("serve")
        subprocess.run(
            [str(serve_cli), "build", "serve_app:app", "-o", str(out)],
            cwd=root,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        doc = yaml.safe_load(out.read_text())
    app = doc["applications"][0]
    app["name"] = cfg.app_name
    app["route_prefix"] = cfg.route_prefix
    env_vars = dict(REPLICA_ENV)
    if cfg_json != "{}":
        env_vars[CONFIG_ENV] = cfg_json
    app["runtime_env"] = {"env_vars": env_vars}
    return HEADER + "\n" + yaml.safe_dump(doc, sort_keys=False, width=100)
