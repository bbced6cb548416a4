"""SIGTERM against a real server: running requests finish (however long they take, up to --shutdown-timeout),
new ones get a 503 with Retry-After while they do, /health says draining, and past the timeout each open stream
ends with an error event and [DONE] and the exit code says so."""

import contextlib
import json
import signal
import socket
import time

import httpx
from server_process import ServerProcess

from dsaserve.server.launcher import CUT_EXIT_CODE

STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
# About 6 MB of events: more than the kernel buffers between a server and a client that does not read.
BIG_STREAM = {**STREAM, "n": 3, "logprobs": 20}


def request_bytes(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def response_of(sock) -> bytes:
    sock.settimeout(60)
    received = b""
    while chunk := sock.recv(1 << 16):
        received += chunk
    sock.close()
    return received


class UnreadStream:
    """A streamed completion from a client that does not read: with a small receive buffer the server's send
    blocks, so the request stays in flight until this client reads, as a slow client's would."""

    def __init__(self, server, body: dict):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", server.port))
        self.sock.sendall(request_bytes(json.dumps(body).encode()))

    def read_all(self) -> list[str]:
        """The stream's data lines, to the end of the response."""
        head, _, body = response_of(self.sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


def wait_until_running(server) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["dsaserve:num_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@contextlib.contextmanager
def started(tiny_checkpoint, *extra):
    srv = ServerProcess(tiny_checkpoint, "--max-model-len", "4096", *extra)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def finished_normally(lines: list[str], n: int, tokens: int) -> bool:
    chunks = [json.loads(line) for line in lines[:-1]]
    choices = [c for chunk in chunks for c in chunk.get("choices", [])]
    return (lines[-1] == "[DONE]" and not any("error" in c for c in chunks)
            and all(sum(c["index"] == i for c in choices) == tokens for i in range(n))
            and sum(c["finish_reason"] == "length" for c in choices) == n)


def test_while_draining_new_requests_get_503_and_health_says_draining(tiny_checkpoint):
    with started(tiny_checkpoint) as srv, httpx.Client(base_url=srv.url, timeout=30) as kept_alive:
        assert kept_alive.get("/v1/models").status_code == 200
        # A request in flight: its body is still arriving.
        body = request_bytes(json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode())
        in_flight = socket.create_connection(("127.0.0.1", srv.port))
        in_flight.sendall(body[:-10])
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        new = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        for response in (new, kept_alive.get("/v1/models")):
            assert response.status_code == 503 and response.headers["retry-after"] == "5"
            assert response.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        in_flight.sendall(body[-10:])
        head, _, answer = response_of(in_flight).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(answer)["usage"]["completion_tokens"] == 4
        assert srv.proc.wait(30) == 0


def test_a_request_running_longer_than_30_seconds_after_sigterm_finishes(tiny_checkpoint):
    with started(tiny_checkpoint) as srv:
        stream = UnreadStream(srv, BIG_STREAM)
        wait_until_running(srv)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(33)  # (the graceful wait used to be a hard-coded 30 s)
        assert srv.proc.poll() is None
        assert finished_normally(stream.read_all(), 3, 3000)
        assert srv.proc.wait(30) == 0


def test_past_the_shutdown_timeout_streams_end_with_an_error_and_done(tiny_checkpoint):
    lines = []
    with started(tiny_checkpoint, "--shutdown-timeout", "1") as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json=STREAM, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 1:
                        srv.proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "[DONE]" and 1 < len(lines) < 3000
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
        assert srv.proc.wait(30) == CUT_EXIT_CODE
