"""The OpenAI-compatible HTTP server on the engine (``kvopt serve``).

:mod:`engine_client` runs the engine on its own thread and streams outputs back to asyncio;
:mod:`protocol` holds the request models, :mod:`responses` the response bodies and stream chunks,
:mod:`app` the handlers and limits, :mod:`metrics` the Prometheus export, :mod:`server` uvicorn.
Imports point one way: serving -> engine -> methods -> cache.
"""

from kvopt.serving.app import ServerSettings, build_app
from kvopt.serving.engine_client import EngineClient
from kvopt.serving.server import ThreadedServer, serve

__all__ = ["EngineClient", "ServerSettings", "ThreadedServer", "build_app", "serve"]
