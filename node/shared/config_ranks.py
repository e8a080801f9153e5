"""``[ranks]`` and ``[allreduce]``: how a site's processes talk to each other with
torch.distributed, kept apart from the gossip settings because nothing here crosses
a site boundary except the all-reduce baseline, which has no gossip at all."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The all-reduce baseline is chosen like a protocol (``gossip.protocol = "allreduce"``)
# so every tool that compares protocols can name it, but it is not a gossip core.
ALLREDUCE = "allreduce"


class RanksConfig(BaseModel):
    """``[ranks]``: a site of several processes (``torchrun`` or ``gossipd node --ranks R``).

    Rank 0 is the site's gossip member; every rank all-reduces gradients each step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend inside the site; auto: nccl on CUDA, else gloo",
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="a collective that has not completed in this long ends the site (a rank "
        "died or hangs) instead of hanging it; longer than the slowest step and merge",
    )
    master: str = Field(
        "127.0.0.1:0",
        description="rendezvous HOST:PORT for `gossipd node --ranks R` (port 0: a free one); "
        "torchrun gives its own",
    )


class AllreduceConfig(BaseModel):
    """``[allreduce]``: the synchronous DDP baseline, one process group across all sites.

    For benchmarks and comparisons only: every site waits for the slowest each step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    master: str = Field(
        description="HOST:PORT where the site with job.shard_index = 0 hosts the rendezvous; "
        "the same on every site"
    )
