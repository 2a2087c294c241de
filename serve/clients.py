"""HTTP clients for an OpenAI-compatible server, keeping idle connections shorter than the server does.

vLLM's HTTP server (uvicorn) closes a keep-alive connection left idle for 5 s
(``--timeout-keep-alive``, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and httpx, under
the OpenAI client, keeps an idle connection pooled for 5 s as well. A request
sent on a pooled connection just as the server closes it fails with
"Server disconnected without sending a response" (``APIConnectionError``)
although the server never saw it: a spurious failure in a load generator at a
low request rate, and in a test whose workers pause between requests (seen
once in CI). The clients made here drop a connection idle for ``KEEPALIVE_S``,
well before the server does, and open a new one instead.
"""

from __future__ import annotations

import importlib
from typing import Any

import httpx

KEEPALIVE_S = 2.0  # below the server's 5 s keep-alive timeout (uvicorn's and vLLM's default)


def http_limits(max_connections: int | None = None, *, module: Any = httpx) -> Any:
    """Connection-pool limits with idle connections dropped after ``KEEPALIVE_S``."""
    return module.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                         keepalive_expiry=KEEPALIVE_S)


def openai_client(base_url: str, *, asynchronous: bool = False, api_key: str = "EMPTY", timeout: float = 600,
                  max_retries: int = 0, max_connections: int | None = None) -> Any:
    """``openai.OpenAI`` (or ``AsyncOpenAI``) on ``base_url`` (``.../v1``), with ``http_limits``.

    No retries by default: a retry hides a failure and inflates a measured latency."""
    import openai

    http_class = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
    # the OpenAI client builds on httpx, or on its fork httpx2 in recent versions: take Limits from that module
    base = next(c for c in http_class.__mro__[1:] if c.__name__ in ("Client", "AsyncClient"))
    module = importlib.import_module(base.__module__.partition(".")[0])
    http_client = http_class(limits=http_limits(max_connections, module=module), timeout=timeout)
    client_class = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return client_class(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries,
                        http_client=http_client)
