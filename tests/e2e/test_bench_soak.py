"""``vtoken bench soak``'s short form on the real served stack (Ray Serve, two vLLM replicas, a replica killed
mid-run). Its request mix and outcome accounting are tests/unit/bench/test_soak_client.py."""

from __future__ import annotations

import pytest

from vtoken.bench.served.soak_client import ABORTED


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_short_soak_accounts_for_every_request_and_leaves_nothing_behind():
    """The short form (fixed seed): every check of the report holds — each request completed, failed
    cleanly or was aborted by its client; a replica was killed mid-run and the replicas went idle with their
    KV invariant check clean and no block held; the pool forced preemptions; no engine process left; greedy
    mode-none replay equal."""
    from vtoken.bench.served.soak import SoakSetup, run_soak

    report = run_soak(SoakSetup(duration_s=45, concurrency=4, seed=0, pool_blocks=40))  # 40: two long requests preempt
    print(
        f"\n[soak] {report['requests']} requests {report['outcomes']} killed {report['killed_replica']} "
        f"preemptions {report['preemptions']} replay {report['replay']['compared']} in {report['seconds']} s"
    )
    assert report["checks"] and all(report["checks"].values()), (report["checks"], report["unaccounted"])
    assert sum(report["outcomes"].values()) == report["requests"] > 0
    assert report["outcomes"][ABORTED] > 0 and report["replay"]["compared"] > 0
