"""Tensors for the segment, codec and wire tests: named zeros of given shapes and dtypes (a
model's tensors, for plans), and seeded values of a dtype (payloads)."""

from __future__ import annotations

import torch

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16


def named(*specs: tuple[str, tuple[int, ...], torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(shape, dtype=dtype)) for name, shape, dtype in specs]


def seeded_values(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dtype)
