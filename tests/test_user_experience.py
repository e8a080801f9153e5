"""What a new user meets first: --help, the plot, the progress display, the install lines
(the demo itself runs in test_demo.py)."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from gossipd.bench import overlap as bench_overlap
from gossipd.bench import protocols as bench_protocols
from gossipd.bench import shaping as bench_shaping
from gossipd.bench import transport as bench_transport
from gossipd.node.cli.main import build_parser
from gossipd.node.launch.plot import LOCAL_ONLY_LABEL, STOP_LABEL, mesh_figure, plot_mesh
from gossipd.node.launch.progress import MeshProgress

ROOT = Path(__file__).resolve().parents[1]
SPHINX = re.compile(r"``|:(func|class|meth|mod|attr|exc|data|obj):`")


def _parsers(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        *_parsers(build_parser(), "gossipd"),
        ("gossipd bench transport (its own parser)", bench_transport.build_parser()),
        ("python -m gossipd.bench.protocols", bench_protocols.build_parser()),
        ("python -m gossipd.bench.shaping", bench_shaping.build_parser()),
        ("gossipd bench overlap (its own parser)", bench_overlap.build_parser()),
    ]


def test_every_flag_of_every_subcommand_has_help_and_shows_its_default() -> None:
    missing = []
    for name, parser in _all_parsers():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{flag}: no help text")
                continue
            switch = isinstance(action.default, bool)  # store_true: off unless given
            if action.default not in (None, []) and not switch and "default" not in action.help:
                missing.append(f"{flag}: help does not show its default {action.default!r}")
    assert not missing, "\n".join(missing)


def test_no_help_output_contains_sphinx_markup() -> None:
    bad = [name for name, parser in _all_parsers() if SPHINX.search(parser.format_help())]
    assert not bad, f"raw Sphinx markup in the --help of: {bad}"
    # And as a user types it: `gossipd bench transport --help` is handed to the bench's parser.
    shown = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "bench", "transport", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "goodput" in shown.lower() and not SPHINX.search(shown), shown


def _history(start: float, stop_s: float, final: float) -> list[dict[str, float]]:
    times = [1.0, 3.0, 5.0, stop_s]
    accs = [0.91, 0.95, final - 0.01, final]
    return [
        {"unix_s": start + t, "step": 100 * (i + 1), "loss": 0.5 / (i + 1), "test_accuracy": a}
        for i, (t, a) in enumerate(zip(times, accs, strict=True))
    ]


def test_plot_zooms_accuracy_to_the_data_and_marks_where_training_stopped(tmp_path: Path) -> None:
    start, ready_s = 1_000.0, 10.0
    result = {
        "protocol": "crossover",
        "job": "digits",
        "nodes": [{"node_id": f"node-{i}"} for i in range(4)],
        "start_unix_s": start,
        "ready_s": ready_s,
        "timeline": [{"t": 0.0, "consensus_distance": 1.5}]
        + [{"t": ready_s + t, "consensus_distance": 10.0**-t} for t in (1, 3, 5, 7)],
    }
    stops = [6.5, 7.0, 6.8, 6.9]  # seconds of training, as each node's last evaluation says
    histories = {
        f"node-{i}": _history(start + ready_s, stop, 0.97 - 0.002 * i)
        for i, stop in enumerate(stops)
    }
    fig = mesh_figure(result, histories)
    axes = {ax.get_title(): ax for ax in fig.axes}
    acc = next(ax for title, ax in axes.items() if "accuracy" in title)
    low, high = acc.get_ylim()
    assert 0.5 < low < 0.964 and high >= 1.0, (low, high)
    cons = next(ax for title, ax in axes.items() if "consensus" in title)
    assert cons.get_yscale() == "log"
    for ax in fig.axes:
        marks = [line for line in ax.get_lines() if line.get_label().startswith(STOP_LABEL)]
        assert len(marks) == 1, ax.get_title()
        assert set(marks[0].get_xdata()) == {max(stops)}
        assert ax.get_legend() is not None
    title = fig._suptitle.get_text()
    assert "crossover" in title and "4 nodes" in title

    # The same picture from node directories, as `gossipd demo` writes it.
    for name, rows in histories.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_mesh(result, sorted(tmp_path.glob("node-*")), tmp_path / "out" / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_the_demo_draws_each_site_alone_dashed_and_with_gossip_solid_in_one_colour(
    tmp_path: Path,
) -> None:
    start, ready_s = 1_000.0, 10.0

    def run(start_s: float) -> dict[str, Any]:
        timeline = [
            {"t": 0.0, "consensus_distance": 1.5},
            {"t": ready_s + 7, "consensus_distance": 1.0},
        ]
        return {"protocol": "sumweight", "job": "digits", "job_options": {"partition": "by_label"},
                "nodes": [{"node_id": f"node-{i}"} for i in range(4)], "start_unix_s": start_s,
                "ready_s": ready_s, "timeline": timeline}  # fmt: skip

    local = run(start - 100.0)  # the first run, 100 s earlier: each run keeps its own clock
    alone = {f"node-{i}": _history(local["start_unix_s"] + ready_s, 7.0, 0.30) for i in range(4)}
    together = {f"node-{i}": _history(start + ready_s, 7.0, 0.96) for i in range(4)}
    fig = mesh_figure(run(start), together, (local, alone))
    acc = next(ax for ax in fig.axes if "accuracy" in ax.get_title())
    lines = {line.get_label(): line for line in acc.get_lines()}
    for i in range(4):
        solid, dashed = (
            lines[f"node-{i} gossip (final 0.960)"],
            lines[f"node-{i} local only (final 0.300)"],
        )
        assert solid.get_linestyle() == "-" and dashed.get_linestyle() == "--"
        assert solid.get_color() == dashed.get_color()
        assert list(dashed.get_xdata()) == list(solid.get_xdata())  # both from their own start
    assert acc.get_ylim()[0] < 0.3
    title = fig._suptitle.get_text()
    assert "local only" in title and "0.300–0.300" in title and "0.960–0.960" in title
    assert "partition=by_label" in title

    for name, histories in (("alone", alone), ("together", together)):
        for node, rows in histories.items():
            (tmp_path / name / node).mkdir(parents=True)
            (tmp_path / name / node / "history.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows)
            )
    dirs = {name: sorted((tmp_path / name).glob("node-*")) for name in ("alone", "together")}
    path = plot_mesh(run(start), dirs["together"], tmp_path / "demo.png", (local, dirs["alone"]))
    with Image.open(path) as image:
        runs = json.loads(image.text["Description"])
    assert runs == {
        "gossip": {f"node-{i}": 0.96 for i in range(4)},
        LOCAL_ONLY_LABEL: {f"node-{i}": 0.30 for i in range(4)},
    }


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_live_table_with_named_columns(tmp_path: Path) -> None:
    spec = SimpleNamespace(
        nodes=2,
        job="digits",
        protocol="sumweight",
        insecure=False,
        duration_s=6.0,
        max_steps=0,
        sample_interval_s=2.0,
        workdir=None,
        ranks=1,
        coordinator=None,
    )
    out = _Terminal()
    states = [
        {
            "node_id": f"node-{i}",
            "step": 50 + i,
            "loss": 0.25,
            "round": 50,
            "live_peers": ["x"],
            "pushes_acked": 7,
        }
        for i in range(2)
    ]
    with MeshProgress(out, spec, tmp_path) as progress:
        progress.starting()
        assert progress.live is not None and progress.live.is_started
        progress.ready(1.5)
        progress.sample(3.0, states, 0.01)
        progress.live.refresh()
        progress.training_done()
    shown = out.getvalue()
    assert "starting 2 nodes" in shown
    for column in ("node", "step", "steps/s", "loss", "round", "live peers", "pushes"):
        assert column in shown
    assert "all nodes stopped training" in shown


def test_readme_install_is_one_pip_command_that_ci_runs_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert "venv" in block[0], "the virtual environment comes before the install"
    pips = [line for line in block if "pip install" in line]
    assert len(pips) == 1, block
    pip = pips[0]
    assert "torch==2.13.0" in pip.split() and "-e" in pip.split() and "'.[dev]'" in pip.split()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert pip in ci
    installs = [line for line in ci if "pip install" in line and not line.startswith("#")]
    assert installs == ["python -m pip install --quiet --upgrade pip", pip], installs


def test_readme_quickstart_shows_the_demos_picture_of_both_runs() -> None:
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    images = re.findall(r"!\[[^\]]+\]\((docs/[^)]+\.png)\)", section)
    assert len(images) == 1, images
    with Image.open(ROOT / images[0]) as image:
        runs = json.loads(image.text["Description"])  # written by plot_mesh with both runs
    assert set(runs) == {"gossip", LOCAL_ONLY_LABEL}
    assert len(runs["gossip"]) == len(runs[LOCAL_ONLY_LABEL]) == 4
    # The numbers the text quotes are the picture's; the text says the sites end at 0.87 or more.
    assert max(runs[LOCAL_ONLY_LABEL].values()) < 0.4 < 0.85 < min(runs["gossip"].values())
    for name, accuracy in runs["gossip"].items():
        assert f"{name}              {runs[LOCAL_ONLY_LABEL][name]:.4f}" in section, name
        assert f"{accuracy:.4f}" in section, name


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["mesh", "up", "--help"]])
def test_help_runs_as_a_user_types_it(argv: list[str]) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "usage: gossipd" in shown and not SPHINX.search(shown)


@pytest.mark.parametrize(
    ("command", "earlier"),
    [(["mesh", "up"], "node-0/checkpoint.pt"), (["demo"], "gossip/node-1/checkpoint.pt")],
)
def test_a_workdir_holding_an_earlier_runs_nodes_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], earlier: str
) -> None:
    """Its nodes would resume from their checkpoints: a run of the same command again
    trained nothing (they had reached --max-steps) and printed that run's table as its own."""
    from gossipd.node.cli.main import main

    workdir = tmp_path / "runs"
    (workdir / earlier).parent.mkdir(parents=True)
    (workdir / earlier).write_bytes(b"an earlier run's checkpoint")
    before = sorted(workdir.rglob("*"))

    assert main([*command, "--nodes", "2", "--max-steps", "50", "--workdir", str(workdir)]) == 2

    err = capsys.readouterr().err
    assert f"gossipd: error: --workdir {workdir} holds an earlier run's node state" in err, err
    assert str(workdir / earlier) in err and "give a new or empty --workdir" in err, err
    assert sorted(workdir.rglob("*")) == before, "something was written before the refusal"
