"""An engine process never outlives the process that started it (issue 29).

vLLM's engine core (``VLLM::EngineCore``) and its workers (``VLLM::Worker``) are child processes of whoever
built the engine — in vToken's serving stack, a Ray Serve replica. vLLM notices a dead worker (the engine
core watches them) but nothing in vLLM 0.32 notices a dead *front end*: when the replica process dies without
running its cleanup (SIGKILL of the actor, ``ray stop --force``, a raylet crash, the OOM killer), the engine
core is reparented to PID 1 and keeps its memory (GPU memory on a GPU node) indefinitely.

How: vLLM calls the ``vllm.general_plugins`` entry point (``vtoken.vllm.plugin.register``) in every process
it starts. When ``EXIT_WITH_PARENT_ENV`` is set in the environment the process inherited (the Serve replica
sets it before it builds its engine: ``vtoken.serve.replica.engine.engine_exits_with_replica``),
``watch_parent`` starts a daemon thread that records the parent's PID and polls ``os.getppid()`` every
``period_s``: a change means the parent died (the kernel reparents an orphan to PID 1 or a subreaper). The
process then stops itself: SIGTERM first (vLLM's own handler shuts the engine down and its workers with it),
and if it is still alive ``grace_s`` later, ``os._exit``. Each worker watches the engine core the same way.

Why polling, not ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the parent *thread* that forked
the child exits, and the replica starts its engine from whichever thread its event loop runs on; a poll of
the parent's PID has no such false positive, costs one syscall a second, and is portable. Opt-in by the
environment only: a process of a user's own vLLM (a ``nohup``-ed script, say) must not exit with its shell.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger("vtoken.vllm")

EXIT_WITH_PARENT_ENV = "VTOKEN_EXIT_WITH_PARENT"  # "1": this process and its vLLM children exit with parent
POLL_PERIOD_S = 1.0
GRACE_S = 5.0
_THREAD_NAME = "vtoken-parent-watchdog"


def watch_parent(period_s: float = POLL_PERIOD_S, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the parent watchdog in this process if ``EXIT_WITH_PARENT_ENV`` asks for it (idempotent: one
    thread per process). Returns the thread, or ``None`` when not asked or the parent is already gone
    (PID 1: nothing left to watch). Side effects: a daemon thread; later, possibly SIGTERM to this process
    and ``os._exit(1)``."""
    if os.environ.get(EXIT_WITH_PARENT_ENV) != "1":
        return None
    parent = os.getppid()
    if parent <= 1:
        return None
    for thread in threading.enumerate():
        if thread.name == _THREAD_NAME and thread.is_alive():
            return thread
    thread = threading.Thread(target=_watch, args=(parent, period_s, grace_s), name=_THREAD_NAME, daemon=True)
    thread.start()
    return thread


def _watch(parent: int, period_s: float, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(period_s)
    logger.warning(
        "vToken: process %d lost its parent %d (reparented to %d): shutting down", os.getpid(), parent, os.getppid()
    )
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        time.sleep(grace_s)
        os._exit(1)
