"""Job options from a command line: ``--job-option KEY=VALUE`` for `mesh up` and `demo`.

A value is read as a TOML scalar (``64``, ``0.5``, ``true``, ``"cnn"``); a bare word
(``by_label``) is taken as a string, so a shell user need not quote. The options
end up in every node's ``[job.options]`` table, so only what a TOML file can hold
there is accepted: a bare key and a finite scalar. :func:`check_job_options` builds
the job once in the launcher, so an option the job does not know, or more sites than
its data splits into, fails with the job's own message before any node starts, not in
every node's log.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable
from typing import Any

from gossipd.node.errors import ConfigError

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]*")
_EXAMPLE = "e.g. --job-option partition=by_label or --job-option model=cnn"


def parse_job_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as a (key, value) pair; ConfigError naming ``text`` if it is not one."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"--job-option {text!r}: write it as KEY=VALUE, {_EXAMPLE}")
    if not _BARE_KEY.fullmatch(key):
        raise ConfigError(
            f"--job-option {text!r}: key {key!r} may hold only letters, digits, '_' and '-'"
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if not _BARE_WORD.fullmatch(raw):
            raise ConfigError(
                f"--job-option {text!r}: value {raw!r} is not a TOML scalar; write a number, "
                f'true/false, a word, or a quoted string ({key}="...")'
            ) from None
        value = raw
    if isinstance(value, bool | int | str):
        return key, value
    if isinstance(value, float) and math.isfinite(value):
        return key, value
    raise ConfigError(
        f"--job-option {text!r}: value {raw!r} is a {type(value).__name__}; a job option "
        "from the command line is a number, true/false or a string (finite numbers only)"
    )


def parse_job_options(texts: Iterable[str]) -> dict[str, Any]:
    """Every ``--job-option`` in order; a key given twice is an error, not a silent override."""
    options: dict[str, Any] = {}
    for text in texts:
        key, value = parse_job_option(text)
        if key in options:
            raise ConfigError(
                f"--job-option {key} given twice ({options[key]!r} and {value!r}); keep one"
            )
        options[key] = value
    return options


def check_job_options(job: str, options: dict[str, Any], shards: int = 1) -> None:
    """Build ``job`` with ``options`` here, as the last of ``shards`` shards, so a bad option
    or more sites than the job's data can be split into (``shakespeare`` deals whole plays
    or genres) fails with the job's own error before any node is started."""
    from gossipd.node.jobs.registry import JobSpec, build_job

    build_job(JobSpec(job, shard_index=shards - 1, num_shards=shards, options=dict(options)))
