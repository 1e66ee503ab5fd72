"""Which processes belong to a local multi-node cluster (``vtoken.serve.launch.cluster``), and killing them.

A node is one ``ray start --block`` process started in its own session: its process group holds the
raylet, the agents (and the GCS and dashboard on the head). The Ray workers the raylet forks — Serve's
proxy, controller and replicas — call ``setsid`` and live in groups of their own, and a replica's vLLM
engine processes are *their* children; so a node is its group plus every descendant. Each process also
inherits the cluster's marker variable, but ``setproctitle`` can blank ``/proc/<pid>/environ`` (Ray's
agents do), so the marker only adds stragglers that were re-parented after their node died.

Reads ``/proc`` only; ``kill``/``kill_node_group``/``terminate`` send signals. Zombies are never
reported (their parent reaps them). ``wait_for`` is the bounded polling loop the cluster commands share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

MARKER_ENV = "VTOKEN_CLUSTER"


def snapshot() -> list[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every live, non-zombie process."""
    return list(_procs())


def _procs() -> Iterator[tuple[int, int, int]]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                yield int(entry.name), int(fields[1]), int(fields[2])


def with_descendants(seeds: Iterable[int], procs: list[tuple[int, int, int]]) -> set[int]:
    """``seeds`` and every process whose parent chain reaches one of them (pure)."""
    found = set(seeds)
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in procs:
        children.setdefault(ppid, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def marked(state_dir: Path, procs: list[tuple[int, int, int]]) -> set[int]:
    """Pids whose environment carries ``VTOKEN_CLUSTER=<state_dir>`` (where it is still readable)."""
    needle = f"{MARKER_ENV}={state_dir}".encode()
    out = set()
    for pid, _, _ in procs:
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.add(pid)
        except OSError:
            continue
    return out


def node_pids(pgid: int, procs: list[tuple[int, int, int]] | None = None) -> set[int]:
    """Live pids of the node whose ``ray start`` runs as process group ``pgid`` (group + descendants)."""
    procs = snapshot() if procs is None else procs
    return with_descendants({pid for pid, _, group in procs if group == pgid}, procs)


def cluster_pids(state_dir: Path, groups: Iterable[int]) -> set[int]:
    """Every live process of the cluster: its nodes, and marked stragglers with their descendants."""
    procs = snapshot()
    seeds = {pid for pid, _, group in procs if group in set(groups)} | marked(state_dir, procs)
    return with_descendants(seeds, procs) - {os.getpid()}


def alive(pids: Iterable[int]) -> set[int]:
    live = {pid for pid, _, _ in snapshot()}
    return {pid for pid in pids if pid in live}


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid (gone ones are skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_until_gone(collect, timeout: float, period: float = 0.2) -> set[int]:
    """SIGKILL ``collect()`` repeatedly (a worker may fork meanwhile) until it is empty or ``timeout``
    seconds pass; returns what is still alive then."""
    deadline = time.monotonic() + timeout
    while True:
        left = collect()
        if not left or time.monotonic() > deadline:
            return left
        kill(left)
        time.sleep(period)


def kill_node_group(pgid: int, timeout: float = 30.0, spare=lambda pid: False) -> list[int]:
    """SIGKILL every process of the node in process group ``pgid`` at once (``node_pids``) but those
    ``spare(pid)`` names, then anything it forked meanwhile; returns the pids it killed. TimeoutError if one
    survives ``timeout`` seconds."""

    def targets() -> set[int]:
        return {pid for pid in node_pids(pgid) if not spare(pid)}

    first = targets()  # orphans are re-parented once the raylet dies: keep this snapshot
    kill(first)
    left = kill_until_gone(lambda: alive(first) | targets(), timeout)
    if left:
        raise TimeoutError(f"processes {sorted(left)} of group {pgid} survived SIGKILL for {timeout:.0f} s")
    return sorted(first)


def comm(pid: int) -> str:
    """The process's name (``/proc/<pid>/comm``: what ``setproctitle`` sets, e.g. ``VLLM::EngineCor``);
    ``""`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def title(pid: int) -> str:
    """The process's title (``/proc/<pid>/cmdline``, which ``setproctitle`` rewrites whichever thread calls
    it, while ``comm`` follows only the calling thread's name); ``""`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def is_engine(pid: int) -> bool:
    """A vLLM engine process (``VLLM::EngineCore``, ``VLLM::Worker``), which is no Ray process: by its name
    or by its title (a title set off the main thread leaves the name ``python``)."""
    return comm(pid).startswith("VLLM") or title(pid).startswith("VLLM")


def kill_ray_of_node(pgid: int, timeout: float = 30.0) -> tuple[list[int], list[int]]:
    """What ``ray stop --force`` does on a machine, for the node in process group ``pgid``: SIGKILL its Ray
    processes (raylet, agents, Ray workers and actors — the replicas), *not* the vLLM engine processes the
    replicas started, which must end on their own (vtoken/vllm/lifetime.py). Returns ``(Ray pids killed,
    engine pids left)``. TimeoutError if a Ray process survives ``timeout`` seconds."""
    engines = sorted(pid for pid in node_pids(pgid) if is_engine(pid))
    return kill_node_group(pgid, timeout, spare=is_engine), engines


def terminate(state_dir: Path, groups: Iterable[int], grace_s: float = 10.0) -> tuple[int, list[int]]:
    """SIGTERM every process of the cluster (``cluster_pids``), SIGKILL what is left after ``grace_s``
    (Ray's agents ignore SIGTERM). Returns (processes found, pids still alive: should be [])."""
    groups = list(groups)
    first = cluster_pids(state_dir, groups)
    kill(first, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(first):
        time.sleep(0.2)
    left = kill_until_gone(lambda: alive(first) | cluster_pids(state_dir, groups), 10.0)
    return len(first), sorted(left)


def wait_for(condition, what: str, timeout: float, period: float = 1.0):
    """Poll ``condition()`` until truthy (returns it); TimeoutError naming ``what`` after ``timeout`` s.
    Other exceptions count as "not yet", except RuntimeError, which means "never" and propagates."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except RuntimeError:
            raise
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
        time.sleep(period)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last})" if last else ""))
