"""KV stats, SLA accounting and Prometheus exposition, run in the replica actor (stat logger, sink,
``/metrics`` thread, discovery heartbeat); the stats keys are also read by ``control/``; the discovery
registry actor runs on the Ray head. No imports here; importing this
package has no side effects."""
