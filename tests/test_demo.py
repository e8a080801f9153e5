"""`gossipd demo` as a user runs it, once for the whole module: what it prints, what it
shows (skewed sites alone stay at their classes' share, with gossip reach the global
accuracy), the job options in every node's config, and the plot holding both runs."""

from __future__ import annotations

import io
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.launch.plot import LOCAL_ONLY_LABEL, read_history

DEMO_TIMEOUT_S = 420.0  # two runs of 4 nodes; about 1 min on an idle 2-core VM
DEMO_NODES = 4
DEMO_STEPS = 3_500  # per node and run: steps, not seconds, so a loaded machine trains as far
# Paced, so a fast machine pushes as often per step as the slower ones the bar was measured
# on (unpaced, a machine at 1,100 steps a second per site ended 3,500 steps in 3 s with a
# tenth of the pushes, medians 0.65-0.88); a slower or loaded one is not held back.
DEMO_STEPS_PER_S = 400
SKEWED = {"partition": "by_label"}


def _watch_lines(proc: subprocess.Popen[str], workdir: Path) -> queue.Queue:
    """Each line of stdout and stderr as it arrives, with whether any node had stepped by then.

    A node writes ``initial.pt`` just before its first step, so a line read while no
    ``<run>/node-*/initial.pt`` exists (runs: ``local-only``, ``gossip``) came before any
    node finished a step.
    """
    lines: queue.Queue = queue.Queue()

    def read(stream: io.TextIOBase, name: str) -> None:
        for line in stream:
            stepped = any(workdir.glob("*/node-*/initial.pt"))
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
    cmd += ["--max-steps-per-s", str(DEMO_STEPS_PER_S)]
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
    # On a busy machine the demo warns first that its figures may not hold (busy_machine).
    after = seen[2] if seen[1][1].startswith("gossipd: this machine is busy") else seen[1]
    assert f"starting {DEMO_NODES} nodes" in after[1], text
    assert not stepped and not after[2], f"the first lines came after a node stepped:\n{text}"
    # Without this, a probe that never found a node's initial.pt would pass the line above.
    assert seen[-1][2], f"no node ever stepped as far as the probe could see:\n{text}"

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
    # Then the weakest site with gossip, and why: its share of the weight, its steps, its data.
    weakest = min(result["nodes"], key=lambda n: n["test_accuracy"])
    assert table[DEMO_NODES].startswith(f"weakest site: {weakest['node_id']}, "), text
    share = weakest["sum_weight"] / result["sum_weight_end"]
    assert f"it held {share:.1%} of the mesh's sum-weight at the end" in table[DEMO_NODES]
    assert f"it took {weakest['steps']} steps against the others' median" in table[DEMO_NODES]
    assert table[DEMO_NODES].endswith("only some of the classes (partition=by_label)"), text


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
    (with 12,000 steps, where the medians were 0.93 to 0.96; with 8,000, 0.94 to 0.96 on an
    idle VM; with 6,000 on a busy one, 0.914 to 0.958; with 5,000 under the whole suite,
    0.906 to 0.950, and 0.901 to 0.940 by its 3,500th; the run now takes 3,500) is 0.2
    below it. Steps, not
    seconds: 15 s on a heavily loaded VM gave fewer steps and medians of 0.876 to 0.899. With
    four busy loops beside the suite a push took longer against a step, so fewer merges came
    per step: one site's median was 0.828. The bar (0.775) is still 0.35 above any site alone.
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
        assert statistics.median(together) >= best - 0.2, numbers[-1]
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
