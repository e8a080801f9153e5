"""The built-in jobs' models, and :func:`init_seeded`: initial weights that depend on the
node's seed alone, never on the global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gossipd.node.errors import JobError


def init_seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build a model whose initial weights depend on ``seed`` alone.

    Modules are created on the meta device (no RNG drawn, no memory touched),
    then Linear and Conv weights are drawn from a private generator with torch's
    default distributions, and other modules (BatchNorm) reset to their fixed
    defaults. The global RNG is neither read nor moved, so building a job on one
    thread cannot shift another thread's random numbers.
    """
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=gen)
                if module.bias is not None:
                    bound = 1.0 / math.sqrt(module.weight[0].numel())
                    nn.init.uniform_(module.bias, -bound, bound, generator=gen)
            elif isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                module.reset_parameters()
            elif isinstance(module, PaddedLinear) and module.bulk is not None:
                module.bulk.uniform_(-0.05, 0.05, generator=gen)  # 6x faster than normal_
    return model


def digits_model(kind: object) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if kind == "cnn":
        # BatchNorm gives the model floating buffers, which gossip must average too.
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 10),
        )
    raise JobError(f"job 'digits' option 'model' must be 'mlp' or 'cnn', got {kind!r}")


class PaddedLinear(nn.Module):
    """A regression head plus an optional ``bulk`` vector that only pads the parameter count.

    ``bulk`` never enters the loss, so it gets no gradient and the optimizer skips
    it: memory stays at one copy of the model, a step costs the same at 64M
    parameters as at 33, and only gossip changes ``bulk`` (handy for checking
    that averaging reaches the mean of the initial vectors).
    """

    def __init__(self, dim: int, bulk_numel: int) -> None:
        super().__init__()
        self.head = nn.Linear(dim, 1)
        self.bulk = nn.Parameter(torch.empty(bulk_numel)) if bulk_numel > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).squeeze(-1)
