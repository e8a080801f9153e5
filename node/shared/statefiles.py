"""Small files in a site's data_dir: atomic JSON writes, and one log line per streak of
failed writes (a full disk fails every interval; one line per interval would bury the log).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("gossipd.node.site.site")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class FailureStreak:
    """Logs the first of a run of failed writes at WARNING and the recovery at INFO.

    A full disk fails every interval; one line per interval would bury the log,
    so the failures in between are only logged at DEBUG (and counted in metrics).
    """

    def __init__(self, what: str, advice: str) -> None:
        self.what = what
        self.advice = advice
        self.failures = 0

    def failed(self, err: Exception) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning("%s failed: %s; %s", self.what, err, self.advice)
        else:
            log.debug("%s failed again (%d in a row): %s", self.what, self.failures, err)

    def succeeded(self, path: Path) -> None:
        if self.failures:
            log.info(
                "%s written again to %s after %d failed attempts",
                self.what,
                path,
                self.failures,
            )
            self.failures = 0
