"""The model's large tensors in one mapping advised for transparent huge pages (model/huge_pages.py)."""


import pytest
import torch
from torch import nn

from dsaserve.model import huge_pages


def mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping holding `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head.endswith(":") and line.split()[-1] == "kB":
                fields[head[:-1]] = int(line.split()[1])
    return fields


class Weights(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Parameter(torch.empty(1024, 1024, dtype=torch.bfloat16))  # 2 MiB
        self.register_buffer("packed", torch.empty(300_001, dtype=torch.uint8))  # odd size: the next starts aligned
        self.small = nn.Parameter(torch.empty(100, dtype=torch.float32))
        self.child = nn.Linear(512, 256)  # 512 KiB of fp32


@pytest.mark.skipif(not huge_pages.enabled(), reason="this kernel refuses or lacks transparent huge pages "
                    "(/sys/kernel/mm/transparent_hugepage/enabled)")
def test_large_weights_share_one_mapping_backed_by_huge_pages():
    model = Weights()
    small, big = model.small, model.big
    placed = huge_pages.place_weights(model)
    tensors = [model.big, model.packed, model.child.weight]
    starts = [t.data_ptr() for t in tensors]
    assert model.small.data_ptr() == small.data_ptr() and model.big is big  # small ones stay; Parameters kept
    assert starts[0] % huge_pages.HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    assert starts[1] == starts[0] + 2 * 2**20 and starts[2] == starts[1] + 300_032  # one region, in order
    assert placed == 2 * 2**20 + 300_032 + 512 * 1024 and model.child.weight.shape == (256, 512)
    for t in tensors:
        t.data.fill_(1)  # first written now, as the loader writes weights
    assert mapping_of(starts[0]).get("AnonHugePages", 0) >= 2048


def test_placing_can_be_turned_off(monkeypatch, make_checkpoint):
    """The engine option huge_pages (--no-huge-pages) leaves the weights where torch's allocator put them."""
    from dsaserve import LLM
    from dsaserve import model as model_package

    placed = []
    monkeypatch.setattr(model_package, "place_in_huge_pages", lambda model: placed.append(model) or 0)
    LLM(make_checkpoint("tiny", seed=0), max_model_len=64, progress=False, huge_pages=False)
    assert placed == []
    LLM(make_checkpoint("tiny", seed=0), max_model_len=64, progress=False)
    assert len(placed) == 1


