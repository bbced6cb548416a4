import os
import sys

# Triton kernels run on CPU tensors only under Triton's interpreter, which must be chosen before Triton is first
# imported (its own library functions are decorated then). CI has no GPU: every Triton test runs this way.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def native_bodies() -> list[str]:
    """The families of native bodies this host runs, best first (an AVX-512 BF16 host runs the AVX2 ones too)."""
    from dsaserve.native import torch_ops

    return [b for b in torch.ops.dsaserve.cpu_isas() if b != "none"] if torch_ops.load() else []


NO_BODY = pytest.param(None, marks=pytest.mark.skip(reason="no native body runs here (no C++ compiler, or a CPU "
                                                           "without AVX2): the torch fallback is tested instead"))


@pytest.fixture(params=native_bodies() or [NO_BODY])
def body(request):
    """Runs the test once per body family this host has (cpu_isa), back to the default after."""
    from dsaserve.native import torch_ops

    torch_ops.configure("auto", request.param)
    yield request.param
    torch_ops.configure("auto", "auto")


@pytest.fixture
def interpreter():
    """The process's Triton kernels on for CPU tensors (Triton's interpreter, chosen above); off after."""
    from dsaserve import triton_ops

    triton_ops.configure("on", torch.device("cpu"))
    yield
    triton_ops.configure("auto", torch.device("cpu"))


# The real GLM-5.2 config.json (copied from the project's shared reference data).
REFERENCE_CONFIG = os.path.join(os.path.dirname(__file__), "data", "glm-5.2-config.json")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(name, **kwargs) builds (once per session) a tiny checkpoint and returns its dir."""
    from dsaserve.demo.checkpoint_builder import build_checkpoint

    built = {}

    def make(name: str, **kwargs) -> str:
        if name not in built:
            built[name] = build_checkpoint(str(tmp_path_factory.mktemp(name)), **kwargs)
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint):
    return make_checkpoint("tiny", seed=0)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """`dsaserve serve` on the tiny checkpoint as a real process (see server_process.py), one per module."""
    from server_process import ServerProcess

    srv = ServerProcess(tiny_checkpoint).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """An AsyncLLMEngine stepping on its own thread, one per module."""
    from dsaserve.engine.async_llm_engine import AsyncLLMEngine
    from dsaserve.engine_args import EngineArgs

    eng = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_checkpoint, dtype="float32", block_size=16, max_model_len=256, progress=False))
    yield eng
    eng.shutdown()
