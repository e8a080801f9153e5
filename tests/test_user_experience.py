"""What a new user meets first: the demo's output, --help, the plot, the install lines."""

from __future__ import annotations

import argparse
import io
import json
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from gossipd.bench import protocols as bench_protocols
from gossipd.bench import transport as bench_transport
from gossipd.node.cli import build_parser
from gossipd.node.jobs import JobSpec, build_job
from gossipd.node.plot import LOCAL_ONLY_LABEL, STOP_LABEL, mesh_figure, plot_mesh, read_history
from gossipd.node.progress import MeshProgress

ROOT = Path(__file__).resolve().parents[1]
DEMO_TIMEOUT_S = 420.0  # two runs of 4 nodes; about 1 min 40 s on an idle 2-core VM
DEMO_NODES = 4
DEMO_STEPS = 12_000  # per node and run: steps, not seconds, so a loaded machine trains as far
SKEWED = {"partition": "by_label"}
SPHINX = re.compile(r"``|:(func|class|meth|mod|attr|exc|data|obj):`")


def _watch_lines(proc: subprocess.Popen[str], workdir: Path) -> queue.Queue:
    """Each line of stdout and stderr as it arrives, with whether any node had stepped by then.

    A node writes ``initial.pt`` just before its first step, so a line read while no
    ``node-*/initial.pt`` exists came before any node finished a step.
    """
    lines: queue.Queue = queue.Queue()

    def read(stream: io.TextIOBase, name: str) -> None:
        for line in stream:
            stepped = any(workdir.glob("node-*/initial.pt"))
            lines.put((name, line.rstrip("\n"), stepped))
        lines.put((name, None, None))

    for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        threading.Thread(target=read, args=(stream, name), daemon=True).start()
    return lines


@dataclass
class DemoRun:
    """What one `gossipd demo --json` left: its lines (stream, text, any node stepped yet),
    exit code, result, work dir and plot."""

    seen: list[tuple[str, str, bool]]
    returncode: int
    result: dict[str, Any]
    workdir: Path
    plot: Path

    def text(self) -> str:
        return "\n".join(f"{n}: {line}" for n, line, _ in self.seen)

    def lines(self, stream: str) -> list[str]:
        return [line for n, line, _ in self.seen if n == stream]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`gossipd demo` as a user runs it, with defaults but for its length and paths, shared by
    the tests of its output, what it shows and its plot (the demo runs the mesh twice).

    ``--job-option model=mlp`` (the job's default anyway) shows a given option reaching the
    nodes beside the demo's own ``partition=by_label``.
    """
    tmp_path = tmp_path_factory.mktemp("demo")
    workdir, plot = tmp_path / "mesh", tmp_path / "demo.png"
    cmd = [sys.executable, "-m", "gossipd.node.cli", "demo", "--nodes", str(DEMO_NODES)]
    cmd += ["--duration-s", "0", "--max-steps", str(DEMO_STEPS), "--job-option", "model=mlp"]
    cmd += ["--json", "--workdir", str(workdir), "--plot", str(plot)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = _watch_lines(proc, workdir)
    seen: list[tuple[str, str, bool]] = []
    open_streams = 2
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    try:
        while open_streams:
            name, line, stepped = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                open_streams -= 1
            else:
                seen.append((name, line, stepped))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = DemoRun(seen, proc.returncode, {}, workdir, plot)
    assert proc.returncode == 0, run.text()
    stdout = run.lines("stdout")
    assert len(stdout) == 1, f"--json: exactly one JSON object on stdout:\n{run.text()}"
    run.result = json.loads(stdout[-1])
    return run


def test_demo_says_what_starts_before_any_node_steps_then_a_header_then_json_last(
    demo: DemoRun,
) -> None:
    text, seen = demo.text(), demo.seen
    first_name, first_line, stepped = seen[0]
    # The first line comes before the heavy imports; the next says what starts.
    assert first_name == "stderr" and f"to start {DEMO_NODES} nodes" in first_line, text
    assert "alone" in first_line and "with gossip" in first_line, text
    assert f"starting {DEMO_NODES} nodes" in seen[1][1], text
    assert not stepped and not seen[1][2], f"the first lines came after a node stepped:\n{text}"

    stderr = demo.lines("stderr")
    names = [f"node-{i}" for i in range(DEMO_NODES)]
    headers = [i for i, line in enumerate(stderr) if line.split()[:1] == ["time_s"]]
    assert len(headers) == 2, f"one progress header per run (alone, with gossip):\n{text}"
    for header in headers:
        assert stderr[header].split() == ["time_s", *names, "mean_loss", "consensus"]
        row = stderr[header + 1].split()
        assert len(row) == DEMO_NODES + 3 and float(row[0]) > 0, text

    result = demo.result
    assert result["ok"] and all(n["steps"] > 0 for n in result["nodes"])
    assert all(n["steps"] > 0 for n in result["local_only"]["nodes"])
    assert 0 < result["ready_s"] < result["wall_s"]
    # The summary says each site's final accuracy alone and with gossip, as the JSON does.
    table = stderr[stderr.index(next(x for x in stderr if "accuracy alone" in x)) + 1 :]
    for i, name in enumerate(names):
        alone = result["local_only"]["nodes"][i]["test_accuracy"]
        gossip = result["nodes"][i]["test_accuracy"]
        assert table[i].split() == [name, f"{alone:.4f}", f"{gossip:.4f}"], text


def _shares() -> list[float]:
    """Per site of the demo: the share of the test set in the classes it holds (by_label)."""
    shares = []
    for i in range(DEMO_NODES):
        spec = JobSpec("digits", shard_index=i, num_shards=DEMO_NODES, options=SKEWED)
        job = build_job(spec)
        shares.append(float(torch.isin(job.test_y, job.train_y.unique()).float().mean()))
    return shares


def _global_accuracy() -> float:
    """One model trained on the whole train split, what every site could reach."""
    job = build_job(JobSpec("digits", seed=0))
    for _ in range(1000):
        job.train_step()
    return job.evaluate()["test_accuracy"]


def _late(node_dir: Path, fraction: float) -> list[float]:
    """A node's test accuracies over the last ``fraction`` of its steps."""
    rows = read_history(node_dir)
    return [r["test_accuracy"] for r in rows if r["step"] >= (1 - fraction) * DEMO_STEPS]


def test_demo_sites_alone_stay_at_their_classes_share_and_with_gossip_reach_the_global_accuracy(
    demo: DemoRun,
) -> None:
    """The demo's claim, on its own numbers: a site alone recognises only its own classes;
    with gossip every site gets close to a model trained on all the data.

    Thresholds from measured runs (4 sites, 10,000 steps each, a 2-core VM): alone the sites
    sat at 0.294, 0.300, 0.372 and 0.294 from their first second on, against shares of 0.297,
    0.300, 0.403 and 0.297; with gossip the medians of the last third were 0.91 to 0.96, single
    evaluations dipping to 0.69 when a site has just stepped on its own classes (so medians,
    not last values, meet the bar); the model trained on all the data reaches 0.975, the bar
    (with 12,000 steps, where the medians were 0.93 to 0.96) is 0.855. Steps, not seconds: 15 s
    on a heavily loaded VM gave fewer steps and medians of 0.876 to 0.899.
    """
    shares, best = _shares(), _global_accuracy()
    local, gossip = demo.result["local_only"], demo.result
    numbers = []
    for i, share in enumerate(shares):
        alone = _late(demo.workdir / "local-only" / f"node-{i}", 0.5)
        together = _late(demo.workdir / "gossip" / f"node-{i}", 1 / 3)
        numbers.append(
            f"node-{i}: share {share:.3f}, alone {min(alone):.3f}..{max(alone):.3f}, "
            f"with gossip median {statistics.median(together):.3f} (final "
            f"{gossip['nodes'][i]['test_accuracy']:.3f}), global {best:.3f}"
        )
        print(numbers[-1])
        assert share - 0.15 <= min(alone) and max(alone) <= share + 0.05, numbers[-1]
        assert max(alone) <= best - 0.4, numbers[-1]
        assert statistics.median(together) >= best - 0.12, numbers[-1]
    for run in (local, gossip):  # no weight lost or made in either run
        assert abs(run["sum_weight_end"] - run["sum_weight_start"]) < 1e-9, run
        assert run["sum_weight_start"] == DEMO_NODES and run["exit_codes"] == [0] * DEMO_NODES
    # Alone means alone: the sites' models stayed apart; with gossip they came together.
    assert local["consensus_distance_end"] >= 0.5 * local["consensus_distance_start"], numbers
    assert gossip["consensus_distance_end"] * 10 <= gossip["consensus_distance_start"], numbers


def test_demo_job_options_reach_every_node_of_both_runs(demo: DemoRun) -> None:
    assert demo.result["job_options"] == {"partition": "by_label", "model": "mlp"}
    for run in ("local-only", "gossip"):
        for i in range(DEMO_NODES):
            config = tomllib.loads((demo.workdir / run / f"node-{i}.toml").read_text())
            assert config["job"]["options"] == {"partition": "by_label", "model": "mlp"}, run
    # Alone, the sites did not share a protocol setting with the gossip run.
    alone = tomllib.loads((demo.workdir / "local-only" / "node-0.toml").read_text())
    assert alone["gossip"]["sumweight"] == {"push_probability": 0.0}


def test_demo_plot_holds_both_runs_with_each_sites_final_accuracy(demo: DemoRun) -> None:
    assert demo.result["plot"] == str(demo.plot)
    with Image.open(demo.plot) as image:
        assert image.format == "PNG" and image.size[0] > 1000
        runs = json.loads(image.text["Description"])
    assert set(runs) == {"gossip", LOCAL_ONLY_LABEL}
    for run, result in (("gossip", demo.result), (LOCAL_ONLY_LABEL, demo.result["local_only"])):
        finals = {n["node_id"]: n["test_accuracy"] for n in result["nodes"]}
        assert runs[run] == pytest.approx(finals, abs=1e-9), run


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
        return {"protocol": "sumweight", "job": "digits", "job_options": SKEWED,
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
    )
    out = _Terminal()
    states = [
        {"node_id": f"node-{i}", "step": 50 + i, "loss": 0.25, "round": 50, "live_peers": ["x"]}
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
    for column in ("node", "step", "steps/s", "loss", "round", "live peers"):
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
