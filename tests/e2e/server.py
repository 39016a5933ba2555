"""A `python -m fast.serve` process for the end-to-end tests."""

import os
import socket
import subprocess
import sys
import time

import httpx

from tests.helpers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server on a free port, polled on /health until it answers 200 (llama.cpp's test harness does the same)."""

    def __init__(self, *args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "fast.serve", "--port", str(self.port), "-t", "1", *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env})
        # The first server of a fresh clone compiles the several-sequence kernels before it is healthy: 78 s on a quiet
        # 2-core machine after fast.run compiled the one-token ones, past 120 s on a busy one.
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err
