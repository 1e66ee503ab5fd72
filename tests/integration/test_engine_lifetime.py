"""A process vLLM starts for a Serve replica exits when the process that started it dies (issue 29).

Unit level, no Ray: a stand-in "replica" process starts a child that runs exactly what vLLM runs in its
engine core and workers (the ``vllm.general_plugins`` entry point, ``vtoken.vllm.plugin.register``), then the
replica is SIGKILLed alone (not its process group). Checked by process, not by log line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from vtoken.serve.launch import procs
from vtoken.vllm.lifetime import EXIT_WITH_PARENT_ENV, GRACE_S, POLL_PERIOD_S

EXIT_BOUND_S = POLL_PERIOD_S + 5.0  # a poll period, then SIGTERM's default action (GRACE_S only if it hangs)

# the child says when vLLM's plugin call returned (it shares the replica's stdout); both then sleep until
# the test kills them (the test's `finally` SIGKILLs whatever is left)
CHILD = (
    "import time; from vtoken.vllm.plugin import register; register(); print('registered', flush=True); time.sleep(120)"
)
REPLICA = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (``procs.alive``: an exited orphan only waits for its new parent to reap it)."""
    return bool(procs.alive([pid]))


def _start(env_value: str | None) -> tuple[subprocess.Popen, int]:
    env = {k: v for k, v in os.environ.items() if k != EXIT_WITH_PARENT_ENV}
    if env_value is not None:
        env[EXIT_WITH_PARENT_ENV] = env_value
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    child = int(replica.stdout.readline())
    assert replica.stdout.readline().strip() == "registered"  # the watchdog (if asked) is running
    assert _alive(child)
    return replica, child


@pytest.mark.parametrize("asked", [True, False])
def test_engine_process_exits_when_its_replica_is_sigkilled_alone(asked):
    replica, child = _start("1" if asked else None)
    try:
        os.kill(replica.pid, signal.SIGKILL)  # the replica alone, not its group
        replica.wait(10)
        deadline = time.monotonic() + EXIT_BOUND_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        if asked:
            assert not _alive(child), f"orphan {child} still runs {EXIT_BOUND_S} s after its parent died"
        else:  # without the setting nothing changes (a user's own vLLM may outlive its shell on purpose)
            assert _alive(child)
    finally:
        for pid in (child, replica.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_watchdog_is_off_unless_asked_and_started_once(monkeypatch):
    from vtoken.vllm.lifetime import watch_parent

    monkeypatch.delenv(EXIT_WITH_PARENT_ENV, raising=False)
    assert watch_parent() is None
    monkeypatch.setenv(EXIT_WITH_PARENT_ENV, "1")
    first = watch_parent(period_s=3600, grace_s=GRACE_S)  # this test process's parent outlives the test
    assert first is not None and first.daemon and watch_parent() is first


def test_an_engine_process_is_known_by_its_title_when_its_name_was_not_set():
    """``setproctitle`` called off a process's main thread rewrites its title (``cmdline``) but not its name
    (``comm``, the main thread's): ``procs.is_engine`` reads both (a CI run saw a VLLM::Worker named python)."""
    code = (
        "import sys, threading, setproctitle\n"
        "t = threading.Thread(target=setproctitle.setproctitle, args=('VLLM::Worker',)); t.start(); t.join()\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert not procs.comm(child.pid).startswith("VLLM"), procs.comm(child.pid)
        assert procs.title(child.pid) == "VLLM::Worker"
        assert procs.is_engine(child.pid)
        assert not procs.is_engine(os.getpid())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert procs.title(child.pid) == "" and not procs.is_engine(child.pid)
