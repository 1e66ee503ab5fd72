"""Small ASGI helpers shared by the request guard (``openai_app``) and the proxy failover (``failover``)."""

from __future__ import annotations


def replay_body(body: bytes, receive, more: bool = False, disconnected: dict | None = None):
    """A ``receive`` that first hands out the already-read ``body``, then defers to the real ``receive``
    (the client's disconnect, as Starlette expects). Records a disconnect in ``disconnected["seen"]``."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        message = await receive()
        if disconnected is not None and message["type"] == "http.disconnect":
            disconnected["seen"] = True
        return message

    return replay
