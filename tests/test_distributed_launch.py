"""Starting and stopping ranks as real processes: two "nodes" over loopback, torchrun, SIGTERM, and ranks
that die or fail (the error names the rank and the cause, nothing hangs, no process is left behind)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_process import ServerProcess, free_port

from dsaserve import LLM, SamplingParams
from dsaserve.engine.async_llm_engine import AsyncLLMEngine, EngineStepError
from dsaserve.engine.workers.executor import ExecutorFailure
from dsaserve.engine_args import EngineArgs

PROMPT = "the quick brown fox"
ENGINE = ["--dtype", "float32", "--block-size", "16", "--max-model-len", "256"]


def children(pid: int) -> list[int]:
    """Processes whose parent is pid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def greedy_text(model: str) -> str:
    with LLM(model, dtype="float32", block_size=16, max_model_len=256, progress=False) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def complete(url: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_two_nodes_over_loopback_give_the_same_tokens(tiny_checkpoint):
    expected = greedy_text(tiny_checkpoint)
    port = free_port()
    meet = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    server = ServerProcess(tiny_checkpoint, *meet, "--node-rank", "0")
    node = subprocess.Popen([sys.executable, "-m", "dsaserve", "worker", tiny_checkpoint, *meet, "--node-rank", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server.wait_ready()
        assert complete(server.url) == expected
    finally:
        assert server.stop() == 0  # SIGTERM: drained, and the other node's rank told to exit
        assert node.wait(30) == 0


def test_torchrun_starts_every_rank_and_rank_0_serves(tiny_checkpoint):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    expected = greedy_text(tiny_checkpoint)
    port = free_port()
    proc = subprocess.Popen([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                             str(free_port()), "-m", "dsaserve", "serve", tiny_checkpoint, "--tensor-parallel-size",
                             "2", "--port", str(port), "--served-model-name", "tiny", *ENGINE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        assert complete(url) == expected
        ranks = children(proc.pid)
        assert len(ranks) == 2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what a service manager does: every process gets it
        proc.wait(60)
    assert not any(alive(pid) for pid in ranks)


def wait_healthy(url: str, proc, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("not healthy in time")


def test_sigterm_drains_and_every_rank_exits_zero(tiny_checkpoint):
    server = ServerProcess(tiny_checkpoint, "--tensor-parallel-size", "2").wait_ready()
    workers = children(server.proc.pid)
    assert len(workers) == 1
    assert complete(server.url)
    assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers)


def test_a_worker_killed_mid_request_fails_the_request_and_the_server(tiny_checkpoint):
    server = ServerProcess(tiny_checkpoint, "--tensor-parallel-size", "2").wait_ready()
    (worker,) = children(server.proc.pid)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    os.kill(worker, signal.SIGKILL)
                    killed_at = time.monotonic()
        code = server.proc.wait(60)
        exited_after = time.monotonic() - killed_at
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "rank 1" in error["message"] and "SIGKILL" in error["message"], error
    assert code != 0 and exited_after < 30
    assert not alive(worker)


def test_a_rank_that_cannot_load_names_itself_and_the_cause(tiny_checkpoint, tmp_path):
    port = free_port()
    meet = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "dsaserve", "serve", tiny_checkpoint, *meet, "--node-rank",
                                   "0", "--port", str(free_port()), *ENGINE], stdout=out, stderr=subprocess.STDOUT)
        node = subprocess.Popen([sys.executable, "-m", "dsaserve", "worker", str(tmp_path / "missing"), *meet,
                                 "--node-rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert server.wait(120) == 1
        assert node.wait(30) != 0
    text = log.read_text()
    assert "error: rank 1 failed" in text and "missing" in text, text[-2000:]


INJECT = '''
import os, time
if os.environ.get("DSASERVE_TEST_FAIL_STEP"):
    from dsaserve.engine.workers import worker
    calls = []
    original = worker.Worker.execute
    def execute(self, output):
        calls.append(1)
        if len(calls) == int(os.environ["DSASERVE_TEST_FAIL_STEP"]):
            if os.environ.get("DSASERVE_TEST_HANG"):
                time.sleep(60)
            raise RuntimeError("injected fault in a step")
        return original(self, output)
    worker.Worker.execute = execute
'''


def inject_fault(tmp_path, monkeypatch, step: int, hang: bool = False) -> None:
    """Make the worker processes (only they load this sitecustomize) fail, or hang, in their step-th step."""
    (tmp_path / "sitecustomize.py").write_text(INJECT)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("DSASERVE_TEST_FAIL_STEP", str(step))
    if hang:
        monkeypatch.setenv("DSASERVE_TEST_HANG", "1")


def test_a_worker_raising_in_a_step_stops_the_engine_naming_it(tiny_checkpoint, tmp_path, monkeypatch):
    inject_fault(tmp_path, monkeypatch, step=3)
    llm = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    try:
        with pytest.raises(ExecutorFailure, match="rank 1 failed: RuntimeError: injected fault in a step"):
            llm.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)
        with pytest.raises(ExecutorFailure):  # and it stays failed
            llm.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)
    finally:
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 10


def test_a_worker_dying_while_idle_turns_the_engine_unhealthy(tiny_checkpoint):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoint, dtype="float32", block_size=16,
                                                        max_model_len=256, progress=False, tensor_parallel_size=2))
    try:
        (worker,) = [proc for proc in engine.engine.executor.processes.values()]
        worker.kill()
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running  # /health answers 503
        assert "rank 1" in engine.fatal_error and "SIGKILL" in engine.fatal_error

        async def ask():
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=4), "after"):
                pass

        import asyncio

        with pytest.raises(EngineStepError, match="stopped"):
            asyncio.run(ask())
    finally:
        engine.shutdown()


def test_a_hung_worker_times_the_collective_out(tiny_checkpoint, tmp_path, monkeypatch):
    """A rank that stops answering (alive, not failing) ends the step after dist_timeout seconds."""
    inject_fault(tmp_path, monkeypatch, step=2, hang=True)
    llm = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=256, progress=False,
              tensor_parallel_size=2, dist_timeout=3)
    try:
        started = time.monotonic()
        with pytest.raises(ExecutorFailure, match="timed out"):
            llm.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - started < 20
    finally:
        llm.shutdown()
