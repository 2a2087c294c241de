"""serve.clients: pooled connections are dropped before the server's keep-alive timeout closes them.

A real uvicorn server (vLLM's HTTP server) at its default keep-alive answers /v1/models with the client's
port, so the test sees which connection each request used."""

import asyncio
import json
import threading
import time

import pytest
import uvicorn

from serve.clients import KEEPALIVE_S, openai_client
from serve.launcher import free_port


async def app(scope, receive, send):
    if scope["type"] != "http":  # lifespan
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        return
    body = json.dumps({"object": "list", "data": [
        {"id": str(scope["client"][1]), "object": "model", "created": 0, "owned_by": "test"}]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def test_the_client_keeps_connections_shorter_than_vllms_server():
    import vllm.envs

    assert uvicorn.Config(app).timeout_keep_alive == 5
    assert KEEPALIVE_S <= vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE - 2


def test_a_connection_idle_past_the_keepalive_is_replaced(url):
    with openai_client(url) as client:
        first, second = (client.models.list().data[0].id for _ in range(2))
        assert first == second, "back-to-back requests reuse the pooled connection"
        time.sleep(KEEPALIVE_S + 0.5)  # still inside the server's 5 s: the server would have kept it
        assert client.models.list().data[0].id != second


def test_the_async_client_replaces_an_idle_connection_too(url):
    async def ports():
        async with openai_client(url, asynchronous=True, max_connections=4) as client:
            first = (await client.models.list()).data[0].id
            again = (await client.models.list()).data[0].id
            await asyncio.sleep(KEEPALIVE_S + 0.5)
            return first, again, (await client.models.list()).data[0].id

    first, again, later = asyncio.run(ports())
    assert first == again and later != again
