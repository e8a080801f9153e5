"""The packages built-in jobs take their data from, checked before torch loads.

``gossipd node``, `mesh up` and `demo` check here first, so a site whose job needs a
package that is not installed says so in one line (exit 2) instead of after loading
torch, or in every node's log.
"""

from __future__ import annotations

import importlib.util

from gossipd.node.errors import JobError

#: job name -> (the package its data comes from, how to install it)
JOB_PACKAGES: dict[str, tuple[str, str]] = {
    "mnist1d": ("mnist1d", "pip install mnist1d==0.0.2.post1"),
}


def check_job_package(job: str) -> None:
    """JobError naming the package and the install line if ``job`` needs one that is missing."""
    need = JOB_PACKAGES.get(job)
    if need is None:
        return
    package, install = need
    if importlib.util.find_spec(package) is None:
        raise JobError(
            f"job {job!r} takes its data from the {package} package, which is not installed "
            f"here: {install} (gossipd depends on it, so reinstalling gossipd brings it too)"
        )
