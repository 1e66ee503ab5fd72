"""A multi-node Ray cluster on this machine, started with Ray's own CLI; the Serve config deployed with
``serve deploy`` exactly as KubeRay hands ``serveConfigV2`` over (``make cluster-up`` / ``cluster-down``).

::

    python -m vtoken.serve.launch.cluster up [--workers 3] [--state /tmp/vtoken-cluster]
    python -m vtoken.serve.launch.cluster deploy [deploy/serve_config.yaml]    # serve deploy + wait RUNNING
    python -m vtoken.serve.launch.cluster status | kill-node worker-2 | down

    head      ray start --head --num-cpus 0 (GCS, dashboard for serve deploy, Serve controller, head proxy)
    worker-i  ray start --address <head> --num-cpus 1 --resources '{"worker_i": 1}' (replicas, own proxy)

Every node is one ``ray start --block`` process in its own session, its ports picked free (HTTP,
dashboard and metrics on 127.0.0.1; Ray registers every node under the machine's address — it resolves
127.0.0.1 to it — and its gRPC ports listen on all interfaces, as on any Ray node). ``kill-node`` SIGKILLs
the node's process group and every descendant (``procs.node_pids``: Ray workers run in groups of their
own) at once, the way a lost machine goes; ``down`` stops exactly this cluster — never ``ray stop``,
which kills every Ray process of the machine. Nodes on one machine share an IP, so each worker's Serve
proxy gets its own port (``RAY_SERVE_WORKER_PROXY_HTTP_PORT``); its engines are not pinned to a core
(``VLLM_CPU_OMP_THREADS_BIND=nobind``, one OpenMP thread each: ``ENGINE_THREADS_ENV``) — with more nodes
than cores a fixed pin puts two engines on one core while another idles (a replica starting there was
starved by the busy one beside it for > 400 s), so the OS spreads them. Clients use the head's proxy on
the YAML's ``http_options.port``.
``serve_app.py`` (the YAML's ``import_path``) is on every node's ``PYTHONPATH``, as in k8s/Dockerfile.

Side effects: creates ``--state`` (the cluster's Ray temp dir, node logs, ``cluster.json``) and starts
processes that outlive this command until ``down``; each inherits ``VTOKEN_CLUSTER=<state>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import typer

from vtoken.serve.launch import procs
from vtoken.serve.launch.local import free_port, serving_env
from vtoken.serve.launch.procs import MARKER_ENV, wait_for

DEFAULT_STATE = Path("/tmp/vtoken-cluster")  # short: Ray's socket paths live under it
OBJECT_STORE_BYTES = 100 << 20
REPO_ROOT = Path(__file__).resolve().parents[3]  # serve_app.py: import_path serve_app:app


@dataclass
class Node:
    name: str
    pgid: int
    agent_port: int
    metrics_export_port: int
    proxy_port: int | None = None  # worker proxies only (the head's is the YAML's http_options.port)
    node_id: str = ""


@dataclass
class ClusterState:
    state_dir: str
    gcs_port: int
    dashboard_port: int
    nodes: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def save(self) -> None:
        (Path(self.state_dir) / "cluster.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState:
        data = json.loads((Path(state_dir) / "cluster.json").read_text())
        return cls(**{**data, "nodes": [Node(**n) for n in data["nodes"]]})


def node_env(state_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one node's ``ray start`` (inherited by all its processes; pure)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **serving_env(state_dir)}
    env.update({MARKER_ENV: str(state_dir), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path})
    return {**env, **(extra or {})}


def _ray_start(state_dir: Path, name: str, args: list[str], env: dict[str, str]) -> int:
    """Start ``ray start --block <args>`` in a new session (log: ``<state>/<name>.log``); returns its pid,
    which is also its process group id."""
    argv = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--disable-usage-stats", *args]
    with open(state_dir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return proc.pid


class _Ports:
    """Distinct free ports (``free_port`` draws at random; two draws must not collide)."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def __call__(self) -> int:
        while (port := free_port()) in self.taken:
            pass
        self.taken.add(port)
        return port


def _node_args(state_dir: Path, ports: _Ports) -> tuple[list[str], int, int]:
    agent, metrics = ports(), ports()
    args = [
        "--temp-dir",
        str(state_dir / "ray"),
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--dashboard-agent-listen-port",
        str(agent),
        "--metrics-export-port",
        str(metrics),
    ]
    return args, agent, metrics


def alive_nodes(state: ClusterState, count: int | None = None) -> dict[str, dict] | None:
    """``{node id: {"resources", "is_head"}}`` of the ALIVE nodes, from the dashboard's state API (needs
    Ray); None unless there are ``count`` of them, if given. Raises RuntimeError with the end of its log
    if a node's ``ray start`` process has exited."""
    from ray.util.state import list_nodes

    for n in state.nodes:
        if not procs.node_pids(n.pgid):
            log = Path(state.state_dir) / f"{n.name}.log"
            raise RuntimeError(f"node {n.name} exited: {log.read_text()[-1500:] if log.exists() else ''}")
    alive = [("state", "=", "ALIVE")]
    nodes = list_nodes(address=state.dashboard, filters=alive, raise_on_missing_output=False)
    if count is not None and len(nodes) != count:
        return None
    return {n.node_id: {"resources": n.resources_total, "is_head": n.is_head_node} for n in nodes}


# Engines of nodes that share this machine: no pinning, one compute thread (see the module docstring).
ENGINE_THREADS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def _start_worker(state: ClusterState, i: int, cpus: int, ports: _Ports) -> None:
    """``ray start`` worker ``i`` (appended to ``state.nodes`` and saved)."""
    state_dir = Path(state.state_dir)
    name, proxy = f"worker-{i}", ports()
    common, agent, metrics = _node_args(state_dir, ports)
    args = [
        "--address",
        state.address,
        "--num-cpus",
        str(cpus),
        "--include-log-monitor",
        "false",
        "--resources",
        json.dumps({f"worker_{i}": 1}),
        *common,
    ]
    env = node_env(state_dir, {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy), **ENGINE_THREADS_ENV})
    state.nodes.append(Node(name, _ray_start(state_dir, name, args, env), agent, metrics, proxy))
    state.save()


def start(
    state_dir: Path = DEFAULT_STATE, workers: int = 3, worker_cpus: int = 1, timeout: float = 180.0, echo=print
) -> ClusterState:
    """Start the head and ``workers`` worker nodes; returns once all are ALIVE. On failure stops what it
    started (node logs stay in ``state_dir``) and re-raises."""
    if (state_dir / "cluster.json").exists():
        raise RuntimeError(f"{state_dir} holds a cluster already: run `down --state {state_dir}` first")
    for sub in ("ray", "rpc", "tmp"):
        (state_dir / sub).mkdir(parents=True, exist_ok=True)
    ports = _Ports()
    state = ClusterState(str(state_dir), gcs_port=ports(), dashboard_port=ports())
    state.save()
    try:
        common, agent, metrics = _node_args(state_dir, ports)
        head = [
            "--head",
            "--port",
            str(state.gcs_port),
            "--num-cpus",
            "0",
            "--include-dashboard",
            "true",
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(state.dashboard_port),
            "--ray-client-server-port",
            str(ports()),
            *common,
        ]
        pgid = _ray_start(state_dir, "head", head, node_env(state_dir))
        state.nodes.append(Node("head", pgid, agent, metrics))
        state.save()
        wait_for(lambda: alive_nodes(state, 1), "the head node", timeout)
        for i in range(1, workers + 1):  # one at a time: a raylet has 30 s to register (ray/_private/node.py)
            for attempt in (1, 2):
                _start_worker(state, i, worker_cpus, ports)
                try:
                    nodes = wait_for(lambda n=i + 1: alive_nodes(state, n), f"worker-{i}", timeout)
                    break
                except RuntimeError as exc:  # its `ray start` gave up (raylet slow to register): once more
                    if attempt == 2:
                        raise
                    echo(f"worker-{i}: {str(exc).strip().splitlines()[-1]} — starting it again")
                    procs.kill_until_gone(lambda: procs.node_pids(state.nodes[-1].pgid), 10.0)
                    state.nodes.pop()
        for node_id, info in nodes.items():
            own = [k.replace("_", "-") for k in info["resources"] if k.startswith("worker_")]
            state.node("head" if info["is_head"] else own[0]).node_id = node_id
        state.save()
    except BaseException:
        stop(state_dir, echo=echo, remove=False)
        raise
    echo(
        f"Ray cluster up: head {state.address}, dashboard {state.dashboard}, "
        f"{workers} workers ({', '.join(n.name for n in state.nodes[1:])}); state {state_dir}"
    )
    return state


def deploy(state: ClusterState, config: Path, timeout: float = 600.0, echo=print) -> dict:
    """``serve deploy <config>`` through the head's dashboard, then wait until the apps are RUNNING."""
    import yaml

    serve_cli = str(Path(sys.executable).with_name("serve"))
    env = node_env(Path(state.state_dir))
    subprocess.run(
        [serve_cli, "deploy", str(config), "--address", state.dashboard],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )

    def running():
        out = subprocess.run(
            [serve_cli, "status", "--address", state.dashboard],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        apps = (yaml.safe_load(out) or {}).get("applications") or {}
        failed = {n: a.get("message") for n, a in apps.items() if a.get("status") == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"deploy failed: {failed}")
        return apps if apps and all(a.get("status") == "RUNNING" for a in apps.values()) else None

    apps = wait_for(running, f"the applications of {config} to be RUNNING", timeout, period=2.0)
    echo(f"deployed {config}: {', '.join(apps)} RUNNING")
    return apps


def kill_node(state: ClusterState, name: str, timeout: float = 30.0) -> list[int]:
    """SIGKILL every process of worker node ``name`` at once, as if its machine died
    (``procs.kill_node_group``); returns their pids."""
    if name == "head":
        raise ValueError("kill-node takes a worker node; `down` stops the head")
    return procs.kill_node_group(state.node(name).pgid, timeout)


def stop_ray(state: ClusterState, name: str, timeout: float = 30.0) -> tuple[list[int], list[int]]:
    """``ray stop --force`` on worker node ``name`` (``procs.kill_ray_of_node``: its Ray processes only;
    on one machine the real command would stop every node). Returns (Ray pids killed, engine pids left)."""
    if name == "head":
        raise ValueError("stop-ray takes a worker node; `down` stops the head")
    return procs.kill_ray_of_node(state.node(name).pgid, timeout)


def stop(state_dir: Path = DEFAULT_STATE, grace_s: float = 10.0, echo=print, remove: bool = True) -> list[int]:
    """Stop every process of the cluster in ``state_dir`` (``procs.terminate``), then remove
    ``state_dir`` (only ``cluster.json`` with ``remove=False``). Returns the pids still alive ([])."""
    try:
        groups = [n.pgid for n in ClusterState.load(state_dir).nodes]
    except (OSError, ValueError, TypeError):
        groups = []
    stopped, left = procs.terminate(state_dir, groups, grace_s)
    if not left:
        if remove:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:
            (state_dir / "cluster.json").unlink(missing_ok=True)
    echo(f"cluster in {state_dir} stopped ({stopped} processes)" + (f"; still alive: {left}" if left else ""))
    return left


cli = typer.Typer(help="A multi-node Ray cluster on this machine (ray start) + serve deploy.", no_args_is_help=True)
STATE = typer.Option(DEFAULT_STATE, "--state", help="the cluster's directory (Ray temp dir, logs, state)")
CONFIG = typer.Argument(Path("deploy/serve_config.yaml"), help="a Serve config YAML (serve build output)")


@cli.command("up")
def up_cmd(
    workers: int = typer.Option(3, min=1),
    state: Path = STATE,
    worker_cpus: int = typer.Option(1, "--worker-cpus", min=1),
) -> None:
    """Start the head (0 CPUs) and WORKERS worker nodes."""
    start(state, workers, worker_cpus)


@cli.command("deploy")
def deploy_cmd(config: Path = CONFIG, state: Path = STATE, timeout: float = typer.Option(600.0)) -> None:
    """serve deploy CONFIG on the cluster and wait until it is RUNNING."""
    deploy(ClusterState.load(state), config, timeout)


@cli.command("status")
def status_cmd(state: Path = STATE) -> None:
    """The nodes (name, process group, Ray node id, alive)."""
    for n in ClusterState.load(state).nodes:
        up = "up" if procs.node_pids(n.pgid) else "DOWN"
        typer.echo(f"{n.name:10} pgid {n.pgid:7} node {n.node_id or '?':56} {up}")


@cli.command("kill-node")
def kill_node_cmd(name: str, state: Path = STATE) -> None:
    """SIGKILL every process of worker node NAME (as if its machine died)."""
    typer.echo(f"killed {name}: {len(kill_node(ClusterState.load(state), name))} processes")


@cli.command("stop-ray")
def stop_ray_cmd(name: str, state: Path = STATE) -> None:
    """SIGKILL the Ray processes of worker node NAME, as `ray stop --force` does on a machine (its replicas'
    vLLM engines are left to exit on their own)."""
    killed, engines = stop_ray(ClusterState.load(state), name)
    typer.echo(f"stopped Ray on {name}: {len(killed)} processes; engine processes left {engines}")


@cli.command("down")
def down_cmd(state: Path = STATE) -> None:
    """Stop every node of the cluster; exit 1 if a process is left."""
    if stop(state):
        raise typer.Exit(1)


if __name__ == "__main__":
    cli()
