"""Routing and scaling decisions, run by Serve outside the replicas: ``KVAwareRouter`` in the deployment
handles (the HTTP proxy's for HTTP traffic), ``KVAutoscalingPolicy`` in the Serve controller, the failover
middleware in the proxy. Must stay importable without vLLM. No imports here; importing this package has
no side effects."""
