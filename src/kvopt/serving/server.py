"""Running the app under uvicorn: in the foreground (``kvopt serve``) or on a background thread.

Shutdown on SIGTERM/SIGINT is uvicorn's graceful one (stop accepting connections, let open
requests finish, then stop the engine), plus 503 for any request that still arrives on an open
connection meanwhile; requests still open after ``shutdown_timeout`` seconds end with a 503 too.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from kvopt.errors import KVOptError
from kvopt.serving.app import ServerSettings, build_app
from kvopt.serving.engine_client import EngineClient

if TYPE_CHECKING:
    from kvopt.engine import LLMEngine


#: Seconds past ``shutdown_timeout`` before uvicorn cancels what still runs: the app ends every open request at the
#: timeout itself (a 503), so only a handler stuck outside the engine is ever cancelled.
CANCEL_AFTER_S = 5.0


class Server(uvicorn.Server):
    """uvicorn's server, telling the app as soon as a shutdown signal arrives (it refuses new requests, and ends
    those still open when the shutdown timeout passes)."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.server.drain()
        super().handle_exit(sig, frame)


def serve(load: Callable[[], LLMEngine], settings: ServerSettings, host: str, port: int,
          access_log: bool = True) -> None:  # fmt: skip
    """Listen on ``host:port`` at once (``/health`` answers 503 while ``load`` builds the engine) until a signal.

    A model that fails to load stops the server and raises its error here.
    """
    server: Server | None = None

    def stop(error: BaseException) -> None:
        server.should_exit = True

    client = EngineClient(load, on_failure=stop)
    app = build_app(client, settings)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # kvopt's own lines (engine ready, failures) beside uvicorn's
    log_config["loggers"]["kvopt"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    server = Server(uvicorn.Config(app, host=host, port=port, access_log=access_log, log_config=log_config,
                                   timeout_graceful_shutdown=settings.shutdown_timeout + CANCEL_AFTER_S))  # fmt: skip
    server.run()
    if isinstance(client.failure, KVOptError):
        raise client.failure
    if client.failure is not None:
        raise SystemExit(1)  # the log has the traceback


class ThreadedServer:
    """The server on a background thread of this process, on a free loopback port (tests, notebooks).

        with ThreadedServer(lambda: kvopt.LLM(kv_memory="1GB").engine, ServerSettings("smol")) as server:
            server.wait_ready()
            openai.OpenAI(base_url=server.url + "/v1", api_key="-").completions.create(...)
    """

    def __init__(self, load: Callable[[], LLMEngine], settings: ServerSettings, host: str = "127.0.0.1") -> None:
        self.client = EngineClient(load)
        self.app = build_app(self.client, settings)
        self.server = Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.socket = socket.socket()
        self.socket.bind((host, 0))
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            self.thread.join(0.01)
        return self

    def wait_ready(self, timeout: float = 60.0) -> ThreadedServer:
        """Block until the model is loaded (raising its error if loading failed)."""
        deadline = time.monotonic() + timeout
        while self.client.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.client.failure is not None:
            raise self.client.failure
        if not self.client.ready:
            raise TimeoutError(f"the engine is {self.client.state} after {timeout} s")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.socket.close()
