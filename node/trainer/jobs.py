"""The documented import path of the jobs (docs/library.md): plugins import ``JobSpec``
from here. The jobs live in :mod:`gossipd.node.jobs`; this re-exports every name
:mod:`gossipd.node.jobs.registry` exports, so the two paths cannot drift apart."""

from gossipd.node.jobs.registry import *  # noqa: F403 (the registry's __all__ is the list)
from gossipd.node.jobs.registry import __all__ as __all__
