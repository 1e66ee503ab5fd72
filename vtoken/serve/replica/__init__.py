"""The replica actor (one Ray actor per Serve replica, started by the Serve controller): VTokenReplica,
its vLLM engine arguments and OpenAI app with the request guard. ``asgi.py`` is also used by the proxy's
failover middleware. No imports here; importing this package has no side effects."""
