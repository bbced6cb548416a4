"""Start `dsaserve serve` as a real process on 127.0.0.1 for tests, and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "dsaserve", "serve", model, "--port", str(self.port), "--dtype", "float32",
                "--block-size", "16", "--max-model-len", "512", "--served-model-name", "tiny", *extra]
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env or os.environ.copy())

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                values[sample.name] = sample.value
        return values
