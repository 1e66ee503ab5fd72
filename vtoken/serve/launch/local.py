"""Run the application on this machine: a private single-node Ray cluster bound to loopback.

``LocalCluster`` is shared by ``vtoken serve`` and the integration tests::

    with LocalCluster(http_port=8000) as cluster:      # ray.init + serve.start (≈10 s)
        cluster.deploy(cfg)                             # build_app + serve.run, waits until ready
        ...                                             # http://127.0.0.1:8000/v1
    # serve.shutdown() stops every replica and its engine processes, then ray.shutdown()

Side effects (documented because Ray's workers inherit them): ``__enter__`` sets the environment
variables in ``serving_env()`` in this process before ``ray.init`` — Serve's proxy needs the failover
callback and the engines need the private RPC/temp paths — and creates a private temp directory, removed
on exit (the variables are restored too). The Ray dashboard is off unless ``dashboard=True`` (then bound
to 127.0.0.1).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from vtoken.errors import REFUSAL_PREFIX
from vtoken.serve.config import ServeAppConfig
from vtoken.serve.control.failover import CALLBACK_ENV, CALLBACK_PATH


def serving_env(tmp: Path) -> dict[str, str]:
    """Environment the Ray processes need (pure). Existing values of the caller are kept."""
    rpc = tmp / "rpc"
    return {
        CALLBACK_ENV: CALLBACK_PATH,
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_RPC_BASE_PATH": str(rpc),
        "TMPDIR": str(tmp / "tmp"),
        "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    }


# Ports handed out by ``free_port``: above Ray's worker-port range (10002-19999) and below Linux's
# ephemeral range (32768+), where Ray, vLLM and ZMQ bind their own "any free port" sockets. Ray's fixed
# defaults (GCS 6379, client 10001, dashboard 8265, dashboard agent 52365) are outside it too. A port
# picked with ``bind(0)`` comes from the ephemeral range and can be taken by Ray between the pick and
# the use (seen in CI: 52365, the dashboard agent's fixed port).
FREE_PORT_RANGE = (20000, 32768)


def free_port(host: str = "127.0.0.1", n: int = 1) -> int:
    """A port (the first of ``n`` consecutive ones) that is free on ``host`` now, from FREE_PORT_RANGE.

    Starts at a random offset so that consecutive callers (and TIME_WAIT leftovers) do not collide.
    """
    lo, hi = FREE_PORT_RANGE
    rng = random.Random()
    start = rng.randrange(lo, hi - n)
    for offset in range(0, hi - lo, n + 1):
        base = lo + (start - lo + offset) % (hi - lo - n)
        if all(port_is_free(host, port) for port in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports on {host} in {lo}-{hi - 1}")


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (no side effect once it returns)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortInUseError(OSError):
    """The HTTP port is taken; the message names it and says what to do."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"cannot listen on {host}:{port}: the port is in use (choose another with --port)")


class DeployFailedError(RuntimeError):
    """Serve gave up on the app (its replicas kept failing to start); the message carries the replicas'
    reason, e.g. vToken's start-up refusal of the model."""


def failure_reason(messages: list[str], fallback: str) -> str:
    """The most specific reason in Serve's status messages of a failed app (pure): vToken's start-up refusal
    (``vToken cannot run this engine: …``) when a replica's engine refused the model, else the messages'
    last non-empty line (the replica's exception, when the deployment's message comes last), else
    ``fallback``."""
    lines = [line.strip() for text in messages for line in text.splitlines() if line.strip()]
    for line in lines:
        if REFUSAL_PREFIX in line:
            return line[line.index(REFUSAL_PREFIX) :]
    return lines[-1] if lines else fallback


def deploy_failure_reason(app_name: str, fallback: str) -> str:
    """``failure_reason`` of ``app_name``'s deployments as ``serve.status()`` reports them (reads Serve's
    controller; ``fallback`` if it is gone)."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # the controller may be gone already: keep Serve's own message
        return fallback
    if app is None:
        return fallback
    return failure_reason([app.message] + [d.message for d in app.deployments.values()], fallback)


class LocalCluster:
    """A private Ray + Serve instance (context manager). Not thread-safe; one per process."""

    def __init__(
        self,
        http_host: str = "127.0.0.1",
        http_port: int = 8000,
        num_cpus: int | None = None,
        object_store_bytes: int = 256 << 20,
        dashboard: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.http_host = http_host
        self.http_port = http_port
        self.num_cpus = num_cpus or os.cpu_count() or 2
        self.object_store_bytes = object_store_bytes
        self.dashboard = dashboard
        self.extra_env = dict(extra_env or {})
        self.tmp: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    def __enter__(self) -> LocalCluster:
        """Start Ray and Serve. Raises PortInUseError (before starting anything, or after stopping
        what it started) when the HTTP port cannot be bound."""
        import ray
        from ray import serve

        if not port_is_free(self.http_host, self.http_port):
            raise PortInUseError(self.http_host, self.http_port)
        self.tmp = Path(tempfile.mkdtemp(prefix="vtr-", dir="/tmp"))  # short: Ray's socket paths are limited
        env = {**serving_env(self.tmp), **self.extra_env}
        self._saved_env = {key: os.environ.get(key) for key in env}
        for key, value in env.items():
            if key in self.extra_env or key not in os.environ or key in (CALLBACK_ENV, "TMPDIR"):
                os.environ[key] = value
        for sub in ("rpc", "tmp", "ray"):
            (self.tmp / sub).mkdir(exist_ok=True)
        ray.init(
            num_cpus=self.num_cpus,
            object_store_memory=self.object_store_bytes,
            include_dashboard=self.dashboard,
            dashboard_host="127.0.0.1",
            _temp_dir=str(self.tmp / "ray"),
            _node_ip_address="127.0.0.1",
            configure_logging=True,
            logging_level="WARNING",
            log_to_driver=False,
        )
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": self.http_host, "port": self.http_port})
        except Exception as exc:
            self.__exit__(None, None, None)
            if "Failed to bind" in str(exc):  # taken between the check above and the proxy's bind
                raise PortInUseError(self.http_host, self.http_port) from None
            raise
        return self

    def deploy(self, cfg: ServeAppConfig):
        """Build and run ``cfg`` (replaces an app of the same name); returns when it is RUNNING. Raises
        ``DeployFailedError`` with the replicas' reason when Serve gives up on it."""
        from ray import serve

        from vtoken.serve.launch.app import build_app

        app = build_app(cfg)
        try:
            return serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
        except RuntimeError as exc:  # DEPLOY_FAILED: Serve retried the replica's constructor and gave up
            reason = deploy_failure_reason(cfg.app_name, str(exc))
            raise DeployFailedError(f"the app's replicas could not start: {reason}") from None

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            for key, value in getattr(self, "_saved_env", {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def banner(cfg: ServeAppConfig, url: str, metrics_host: str | None, metrics_port: int | None) -> str:
    """What ``vtoken serve`` prints once the app answers (pure)."""
    model = cfg.model_name
    key = cfg.limits.resolved_api_key()
    auth = ' -H "Authorization: Bearer $VTOKEN_API_KEY"' if key else ""
    api_key = 'os.environ["VTOKEN_API_KEY"]' if key else '"EMPTY"'
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], '
        '"max_tokens": 32}'
    )
    lines = [
        f"vToken is serving {model!r} at {url}/v1 (mode {cfg.vtoken.mode}, policy {cfg.vtoken.policy}, "
        f"budget {cfg.vtoken.budget})",
        "",
        "  curl:",
        f"    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "",
        "  openai (Python):",
        "    python - <<'EOF'",
        "    import os",
        "    from openai import OpenAI",
        f'    client = OpenAI(base_url="{url}/v1", api_key={api_key})',
        f'    r = client.chat.completions.create(model="{model}", max_tokens=32,',
        '        messages=[{"role": "user", "content": "What is the capital of France?"}])',
        "    print(r.choices[0].message.content)",
        "    EOF",
        "",
        f"  routes: {url}/v1/completions, /v1/chat/completions, /v1/models, /health, /ready",
    ]
    if metrics_port is not None:
        lines.append(f"  metrics: http://{metrics_host}:{metrics_port}/metrics (first replica; see docs/metrics.md)")
    lines += ["", "Ctrl-C to stop."]
    return "\n".join(lines)


def run_local(
    cfg: ServeAppConfig, host: str = "127.0.0.1", port: int = 8000, dashboard: bool = False, echo=print
) -> None:
    """Start, print the banner, block until SIGINT/SIGTERM, then stop everything (no stray process).

    The signal handlers are installed after ``ray.init`` (which installs its own SIGTERM handler) and
    restored on exit.
    """
    stop = threading.Event()
    started = time.monotonic()
    with LocalCluster(http_host=host, http_port=port, dashboard=dashboard) as cluster:
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            echo(
                f"starting Ray Serve on {cluster.url} (model {cfg.model}; the first start prepares it; "
                f"temp dir {cluster.tmp}) …"
            )
            cluster.deploy(cfg)
            echo(f"ready in {time.monotonic() - started:.0f} s\n")
            echo(banner(cfg, cluster.url, cfg.metrics.host, cfg.metrics.port))
            while not stop.wait(0.5):
                pass
            echo("\nstopping (serve.shutdown, ray.shutdown) …")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    echo("stopped.")
