"""The low-communication baseline (``gossip.protocol = "diloco"``): DiLoCo (Douillard et
al., 2023) across all sites in one process group.

What the field runs to train across slow links (INTELLECT-1 trained a 10B model across
three continents with it), so it is the baseline gossip must beat where links bind, not
DDP alone. Every site takes H = ``[diloco] inner_steps`` steps of its job's own optimizer
from the shared model, then the sites average their pseudo-gradients (shared model minus
local model) in one all-reduce and each applies the same outer Nesterov step to the shared
model (``outer_learning_rate`` 0.7, ``outer_momentum`` 0.9, the paper's), and trains on
from there. One all-reduce of the model's size per H steps, against DDP's one per step.

Written plainly, for comparisons: no gRPC, no gossip, no checkpoints; one site that dies
stops the others, as with :mod:`gossipd.node.baselines.allreduce`, whose site lifecycle,
signals and files this reuses. The inner optimizer is the job's (SGD with momentum for
digits and mnist1d, Adam for shakespeare; the paper's is AdamW) and keeps its state
across outer steps, as the paper's does. The model the site evaluates and writes is
the shared one, at outer steps: between them no site holds it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import torch
from torch.nn.utils import parameters_to_vector

from gossipd.node.baselines.allreduce import AllreduceSite, run_group_site
from gossipd.node.baselines.allreduce_comm import Collectives
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.config_ranks import DILOCO, DilocoConfig

log = logging.getLogger("gossipd.node.baselines.diloco")


def run_diloco(config: NodeConfig) -> int:
    """``gossipd node`` for ``gossip.protocol = "diloco"``: 0 once the group stopped
    together, 1 when a site left it (one line on stderr says which)."""
    return run_group_site(DilocoSite(config))


class OuterStep:
    """The shared model and its outer optimizer, alike on every site.

    The pseudo-gradient is the shared model minus the local one (what H inner steps moved
    it, as a gradient points); averaged over sites, it is the gradient of a torch SGD with
    Nesterov momentum over the shared model. Two stop flags ride in the same all-reduce,
    so an outer step is one collective.
    """

    def __init__(self, params: list[torch.Tensor], settings: DilocoConfig) -> None:
        self.params = params
        self.shared = torch.nn.Parameter(parameters_to_vector(params).detach().clone())
        self.optimizer = torch.optim.SGD(
            [self.shared],
            lr=settings.outer_learning_rate,
            momentum=settings.outer_momentum,
            nesterov=settings.outer_momentum > 0,
        )

    def sync(self, comm: Collectives, done: bool, signalled: bool) -> tuple[bool, bool]:
        """Average the pseudo-gradients, step the shared model, load it into the local
        one; returns (training done, a site was signalled), true if on any site."""
        with torch.no_grad():
            local = parameters_to_vector(self.params)
            flags = torch.tensor([float(done), float(signalled)], device=local.device)
            message = torch.cat([self.shared.detach() - local, flags])
            comm.average(message)
            self.shared.grad = message[:-2]
            self.optimizer.step()
            # Copied, not aliased: the inner optimizer writes the local parameters in place.
            offset = 0
            for param in self.params:
                param.copy_(self.shared[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
        return bool(message[-2] > 0), bool(message[-1] > 0)


class DilocoSite(AllreduceSite):
    """One DiLoCo site: H local steps, one averaged outer step, again."""

    protocol: ClassVar[str] = DILOCO
    summary_name: ClassVar[str] = "low-communication"

    def __init__(self, config: NodeConfig) -> None:
        super().__init__(config)
        self.settings: DilocoConfig = config.diloco  # type: ignore[assignment]
        self.outer_steps = 0

    def check_every_steps(self) -> int:
        return self.settings.inner_steps

    def _train(self) -> bool:
        """Rounds of H inner steps and an outer step; True when rank 0's max_steps or
        duration_s ended training (checked at outer steps: every site stops together)."""
        job = self.config.job
        schedule = [float(job.max_steps), job.duration_s, float(job.eval_every_steps)]
        steps_limit, duration_s, every = self.comm.rank0_schedule(schedule)
        max_steps, eval_every = int(steps_limit), int(every)
        params = [p.detach() for p in self.model.parameters()]  # the parameters' storage
        self.comm.broadcast_from_rank0(params)  # one shared model to start from, as DDP's
        outer = OuterStep(params, self.settings)
        log.info(
            "DiLoCo: %d inner steps per outer step (outer Nesterov, learning rate %g, "
            "momentum %g); %d parameters averaged per outer step",
            self.settings.inner_steps,
            self.settings.outer_learning_rate,
            self.settings.outer_momentum,
            outer.shared.numel(),
        )
        interval_s = self.config.progress_interval_s
        next_line = time.monotonic() + interval_s
        self.started = time.perf_counter()
        done = signalled = False
        while not (done or signalled):
            inner = self.settings.inner_steps
            if max_steps:
                inner = min(inner, max_steps - self.steps)  # the same on every site
            for _ in range(inner):
                self.loss = float(self.job.train_step())
                self.steps += 1
                if interval_s and time.monotonic() >= next_line:
                    log.info("%s", self._progress_line())
                    next_line = time.monotonic() + interval_s
            ended = self.rank == 0 and (
                (max_steps and self.steps >= max_steps)
                or (duration_s and time.perf_counter() - self.started >= duration_s)
            )
            done, signalled = outer.sync(self.comm, bool(ended), self.signalled.is_set())
            self.outer_steps += 1
            # The shared model exists only here: evaluate it at the first outer step at or
            # past each multiple of eval_every_steps.
            if eval_every and self.steps // eval_every > (self.last_eval_step or 0) // eval_every:
                self.evaluate()
        return done

    def own_summary(self) -> dict[str, Any]:
        return {"inner_steps": self.settings.inner_steps, "outer_steps": self.outer_steps}

    def _progress_line(self) -> str:
        return f"{super()._progress_line()}, {self.outer_steps} outer steps"
