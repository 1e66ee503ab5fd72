"""KV stats, SLA accounting and Prometheus exposition, run in the replica actor (stat logger, sink,
``/metrics`` thread); the stats keys are also read by ``control/``. No imports here; importing this
package has no side effects."""
