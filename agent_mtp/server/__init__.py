"""An OpenAI-compatible HTTP server: a second front end of the one request path (agent_mtp/service.py).

    agent-mtp serve --port 8000 --policy default          # or create_app(ServerSettings(...)) under any ASGI server

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])

Parts (vLLM's OpenAI entrypoint layout): :mod:`.settings` (one pydantic-settings object), :mod:`.protocol` (the
request and response schemas), :mod:`.serving` (an OpenAI request -> a service ``Request``; results and streams ->
OpenAI bodies and chunks; admission), :mod:`.errors` (every error -> the OpenAI error body, in one place),
:mod:`.app` (the app factory). Concurrent requests share forward passes (continuous batching,
:mod:`agent_mtp.engine.batching`). See docs/server.md.
"""

from agent_mtp.server.app import create_app
from agent_mtp.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
