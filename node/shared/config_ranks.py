"""``[ranks]`` and the baselines' sections (``[allreduce]``): how processes talk to each
other with torch.distributed, kept apart from the gossip settings because nothing here
crosses a site boundary except a baseline, which has no gossip at all.

A baseline is chosen like a protocol (``gossip.protocol = "allreduce"``) so every tool
that compares protocols can name it, but it is not a gossip core: its settings are a
section of its own, ``[<its name>]``, listed in :data:`BASELINE_SECTIONS`. How a
baseline's site runs is :mod:`gossipd.node.baselines`' registry, which this room may not
import; the two lists name the same baselines (a test checks).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gossipd.node.shared.config_sections import check_address

ALLREDUCE = "allreduce"
DILOCO = "diloco"


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

    @field_validator("master")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)


class BaselineSection(BaseModel):
    """A baseline's own section, ``[<its name>]``: where its sites meet. Every site of a
    baseline is one rank of one process group across all sites."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    summary: ClassVar[str]  # what the baseline is, for the error naming every protocol

    master: str = Field(
        description="HOST:PORT where the site with job.shard_index = 0 hosts the rendezvous; "
        "the same on every site"
    )

    @field_validator("master")
    @classmethod
    def _fixed_port(cls, value: str) -> str:
        if int(check_address(value).rpartition(":")[2]) == 0:
            raise ValueError(
                "port 0 cannot work here, every site must dial the same rendezvous; give a "
                'fixed free port, the same on every site (for example "10.0.0.1:29500")'
            )
        return value


class AllreduceConfig(BaselineSection):
    """``[allreduce]``: the synchronous DDP baseline, one process group across all sites.

    For benchmarks and comparisons only: every site waits for the slowest each step.
    """

    summary: ClassVar[str] = "the synchronous baseline"


class DilocoConfig(BaselineSection):
    """``[diloco]``: DiLoCo (Douillard et al., 2023), the low-communication baseline.

    Every site takes ``inner_steps`` steps of its job's own optimizer, then the sites
    average their pseudo-gradients (the change since the last outer step) in one all-reduce
    and take one outer Nesterov step. The defaults are the paper's outer settings; H is
    INTELLECT-1's 100 (the paper's 500 is for steps of seconds, not milliseconds).
    """

    summary: ClassVar[str] = "the low-communication baseline"

    inner_steps: int = Field(
        100, ge=1, description="H: local steps between outer steps (one all-reduce each)"
    )
    outer_learning_rate: float = Field(
        0.7, gt=0, allow_inf_nan=False, description="the outer Nesterov step's learning rate"
    )
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, allow_inf_nan=False, description="the outer Nesterov step's momentum"
    )


# Each baseline's section by the name ``gossip.protocol`` selects it with; NodeConfig has
# an optional field of that name and type for each.
BASELINE_SECTIONS: dict[str, type[BaselineSection]] = {
    ALLREDUCE: AllreduceConfig,
    DILOCO: DilocoConfig,
}
