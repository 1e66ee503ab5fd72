"""``VTokenAsyncScheduler``: vLLM's ``AsyncScheduler`` with vToken's hooks (async scheduling: CUDA's default).

Not named in any configuration: ``VTokenScheduler(...)`` builds this class when
``scheduler_config.async_scheduling`` is on, so ``--scheduler-cls vtoken.vllm.scheduler.VTokenScheduler``
works either way. vLLM's ``AsyncScheduler`` schedules step N+1 while step N runs: a decode request gets a
placeholder for the token N is still sampling (``num_output_placeholders``), and N's output is processed
after N+1 was scheduled. The vToken hooks are the same as ``VTokenScheduler``'s (method resolution order:
``VTokenScheduler`` → ``AsyncScheduler`` → ``Scheduler``); what async scheduling changes is handled there:

* the decision counts the placeholder as the step's new token (reuse+repack places it into a hole);
* tokens placed by a step in flight are not evicted until its statistics arrived (like the recent window);
* scores are matched to their step by number and mapped through that step's slot→token map
  (``vtoken/vllm/scheduling/request_state.py``), so a decision taken while the step ran never misattributes them;
* preemption and abort between the two steps drop the request's records: the late scores are dropped.

Moves and truncations of step N+1 run on the worker before N+1's forward and after N's (one stream, in
order), which is the same ordering vLLM relies on when it hands a block freed in N+1 to another request.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vtoken.vllm.scheduler import VTokenScheduler


class VTokenAsyncScheduler(VTokenScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-token eviction and repacking (see the module docstring)."""
