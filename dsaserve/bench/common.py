"""What the bench commands share: random prompts, percentiles, and how results are printed and saved."""

from __future__ import annotations

import json

import torch


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)
    return torch.randint(low, vocab, (num, length), generator=g).tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def print_table(title: str, result: dict) -> None:
    print(title)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
