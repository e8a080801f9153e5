"""`--job-option KEY=VALUE` for `mesh up` and `demo`: read as TOML scalars, and a bad one
fails with a clear message before any node starts.

That a good option reaches every node (and changes what it trains) is checked on a real
demo run in test_user_experience.py; here the commands run in this process, through the
same ``main`` a user's shell calls, and must stop before starting anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gossipd.node.cli.main import main
from gossipd.node.errors import ConfigError
from gossipd.node.launch.joboptions import parse_job_option, parse_job_options


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("partition=by_label", ("partition", "by_label")),  # a bare word is a string
        ('model="cnn"', ("model", "cnn")),
        ("dim=64", ("dim", 64)),
        ("noise = 0.25", ("noise", 0.25)),
        ("shuffle=true", ("shuffle", True)),
        ("numel=1e3", ("numel", 1000.0)),
    ],
)
def test_a_job_option_value_is_read_as_a_toml_scalar(text: str, expected: tuple) -> None:
    assert parse_job_option(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("partition", "write it as KEY=VALUE"),
        ("=by_label", "write it as KEY=VALUE"),
        ("my option=1", "may hold only letters, digits"),
        ("model=[1, 2]", "is a list"),
        ("noise=inf", "finite numbers only"),
        ('model="cnn', "is not a TOML scalar"),
    ],
)
def test_a_malformed_job_option_is_refused_with_its_text_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job_option(text)
    assert repr(text) in str(err.value) and says in str(err.value), err.value


def test_a_job_option_given_twice_is_an_error_not_an_override() -> None:
    with pytest.raises(ConfigError, match="model given twice"):
        parse_job_options(["model=mlp", "model=cnn"])


@pytest.mark.parametrize(
    ("command", "option", "says"),
    [
        # The job's own errors, from building it in the launcher.
        (["mesh", "up"], "nosuch=1", "job 'digits' has no option(s) nosuch; known options"),
        (["mesh", "up"], "partition=diagonal", "'partition' must be 'iid' or 'by_label'"),
        (["demo"], "model=transformer", "'model' must be 'mlp' or 'cnn', got 'transformer'"),
        (["mesh", "up", "--job", "synthetic"], "dim=0", "option 'dim' must be a positive int"),
        # The command line's, before the job is even looked at.
        (["demo"], "partition", "--job-option 'partition': write it as KEY=VALUE"),
    ],
)
def test_a_bad_job_option_fails_before_any_node_starts_and_names_the_option(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    option: str,
    says: str,
) -> None:
    workdir = tmp_path / "mesh"
    argv = [*command, "--nodes", "2", "--job-option", option, "--workdir", str(workdir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "gossipd: error:" in err and says in err, err
    # Nothing was started: no node config, no node directory, not even the work dir.
    assert not workdir.exists(), sorted(workdir.rglob("*"))
