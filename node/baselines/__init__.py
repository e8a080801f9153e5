"""Baselines that share gossipd's harness but not its gossip: synchronous all-reduce (torch
DDP across sites) and DiLoCo (local steps, then an averaged outer step), each run as a
site process of its own.

:data:`BASELINES` is the one list of them, and every place that treats a baseline apart
from the gossip protocols asks it:

- ``gossipd node`` runs a baseline's site with :meth:`Baseline.run_site` (one process per
  site: each site is one rank of the baseline's process group);
- ``gossipd mesh up --protocol NAME`` offers every baseline, and a local mesh of one is
  launched by :mod:`gossipd.node.launch.baseline_mesh`: node-0 hosts the rendezvous, each
  site's ``[NAME]`` section names it, the run ends when every site has exited;
- the config accepts ``gossip.protocol = NAME`` with a ``[NAME]`` section, which
  :data:`gossipd.node.shared.config_ranks.BASELINE_SECTIONS` declares (the config may not
  import this room; a test checks both list the same names).

A new baseline is its module here, with a function ``(config) -> int`` that runs one site
and returns the exit code of ``gossipd node``, one line in :data:`BASELINES`, and its
section in ``config_ranks``.

May import the errors, :mod:`gossipd.node.shared` and the trainer room; never the network,
a gossip site, a launcher or the CLI. This file loads no torch: the CLI lists the baselines
for every command.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipd.node.shared.config_ranks import ALLREDUCE, DILOCO

if TYPE_CHECKING:
    from gossipd.node.shared.config import NodeConfig


@dataclass(frozen=True)
class Baseline:
    """One baseline: its name (as ``gossip.protocol`` and ``--protocol`` give it), a line
    saying what it is, and the function that runs one site of it, as ``module:function``
    (imported only to run a site: it loads torch)."""

    name: str
    description: str
    site_entry: str

    def run_site(self, config: NodeConfig) -> int:
        """``gossipd node`` for this baseline: run the site until its group stops, return the
        exit code (0 once stopped together, 1 when a site left)."""
        module, _, function = self.site_entry.partition(":")
        run: Callable[[NodeConfig], int] = getattr(importlib.import_module(module), function)
        return run(config)


BASELINES: dict[str, Baseline] = {
    baseline.name: baseline
    for baseline in (
        Baseline(
            ALLREDUCE,
            "the synchronous DDP baseline, no gossip",
            "gossipd.node.baselines.allreduce:run_allreduce",
        ),
        Baseline(
            DILOCO,
            "DiLoCo: H local steps, then one all-reduce and an outer Nesterov step",
            "gossipd.node.baselines.diloco:run_diloco",
        ),
    )
}
