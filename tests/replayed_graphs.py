"""A stand-in for torch.cuda.CUDAGraph that checks decode graphs without a GPU (tests/test_decode_graphs.py): capture
runs the forward, each replay runs it again, watched for anything that would break a real capture. `install` turns
graphs on for CPU tensors with it, in the test process (monkeypatch.setattr) or in a worker process of a distributed
engine (worker_site/sitecustomize.py)."""

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsaserve import cuda_graph_sizes
from dsaserve.engine.workers import decode_graphs

# Ops that make the host wait for the device, or copy host data to it, inside a forward (nonzero and its kin size
# their output from the data).
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten.lift_fresh.default", "aten._unique2.default", "aten.unique_consecutive.default",
           "aten.unique_dim.default",
           # On CUDA these read values back inside the operator (bincount its input's range); on CPU nothing shows
           "aten.bincount.default", "aten.histc.default"}


HOST_VALUE_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class HostReads(TorchDispatchMode):
    """Records the operators of SYNCING, a repeat_interleave without its output size and indexing (or writing) by a
    bool mask."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if (name in SYNCING or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None)
                or (name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default")
                    and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))):
            self.seen.append(name)
        return func(*args, **kwargs)


class ReplayedForward:
    """torch.cuda.CUDAGraph's stand-in: capture runs the forward, each replay runs it again into the same output
    tensor, watched for host reads (kept for the whole test; in a worker process also appended to `log`, a line a
    replay: the process id and what it read)."""

    host_reads: list[str] = []
    log: str | None = None

    def __init__(self, pool=None):
        self.forward = self.out = None
        self.replays = 0

    def capture(self, forward):
        self.forward = forward
        self.out = forward()
        return self.out

    total_replays = 0  # every instance's, in this process

    def replay(self):
        self.replays += 1
        type(self).total_replays += 1
        watch = HostReads()
        # A value read on the host (under inference mode a CPU tensor's item() passes no dispatch mode by).
        originals = {name: getattr(torch.Tensor, name) for name in HOST_VALUE_METHODS}
        try:
            for name, method in originals.items():
                setattr(torch.Tensor, name, lambda t, *a, _n=name, _m=method: watch.seen.append(f"Tensor.{_n}")
                        or _m(t, *a))
            with watch:
                for mine, new in zip(self.out, self.forward()):
                    mine.copy_(new)
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
        type(self).host_reads.extend(watch.seen)
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(f"{os.getpid()} {' '.join(watch.seen)}\n")

    def memory_pool(self):
        return None


class HostValueReads:
    """While open, `seen` lists each value read back to the host (item(), tolist(), bool(), .cpu(), ...) with the
    file and line that read it."""

    METHODS = HOST_VALUE_METHODS + ("cpu",)  # (not numpy(): it raises for a device tensor; stagings are host memory)

    def __init__(self):
        self.seen: list[str] = []
        self._originals = {}

    def __enter__(self):
        import traceback

        self._originals = {name: getattr(torch.Tensor, name) for name in self.METHODS}

        def read(tensor, *args, _name, _method):
            where = traceback.extract_stack(limit=3)[0]  # (the caller of the lambda below)
            self.seen.append(f"Tensor.{_name} at {os.path.basename(where.filename)}:{where.lineno}")
            return _method(tensor, *args)

        for name, method in self._originals.items():
            setattr(torch.Tensor, name, lambda t, *a, _n=name, _m=method: read(t, *a, _name=_n, _method=_m))
        return self

    def __exit__(self, *exc):
        for name, method in self._originals.items():
            setattr(torch.Tensor, name, method)


class StepReads:
    """Values each engine step that replayed a graph reads back to the host (HostValueReads), outside the replay
    too (the scheduler, the metadata's staging, sampling, the output): `install(llm.engine, setattr)` wraps its step;
    `per_step` then holds, per replayed step, what it read and where."""

    def __init__(self):
        self.per_step: list[list[str]] = []

    def install(self, engine, setattr_) -> None:
        step = engine.step
        setattr_(engine, "step", lambda: self._watched(step))

    def _watched(self, step):
        replays_before = ReplayedForward.total_replays
        with HostValueReads() as reads:
            out = step()
        if ReplayedForward.total_replays > replays_before:
            self.per_step.append(reads.seen)
        return out


def install(setattr_, log: str | None = None) -> None:
    """Graphs on for CPU tensors, replayed by ReplayedForward (replays logged to `log` where given), context buckets
    of 32 tokens and max_model_len."""
    setattr_(decode_graphs, "graphs_possible", lambda device: True)
    setattr_(decode_graphs, "CudaGraph", ReplayedForward)
    setattr_(cuda_graph_sizes, "SMALLEST_BUCKET", 32)
    ReplayedForward.log = log
