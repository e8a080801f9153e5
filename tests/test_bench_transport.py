"""`gossipd bench transport` end to end on a tiny model, and the push frames it times.

No assertion on how fast anything is (the machine is shared and loopback numbers are
noisy): only relationships that hold at any speed, and two sanity bounds far outside
any real measurement. The push frames it times are checked against protobuf in
``tests/test_push_frames.py``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.bench import trainer_overhead, transport, transport_cli
from gossipd.node.errors import JobError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.net.dial.client import PeerClient
from gossipd.node.trainer.messages import OutboundPush

MODEL_MB = 4
MODEL_BYTES = MODEL_MB << 20
REPS = 2
# Loopback goodput of 4 MiB can exceed no memory bus; anything faster is a timing bug.
MAX_PLAUSIBLE_GBPS = 100.0
# A push goes through gRPC, checksums and a merge: it cannot beat a bare socket by this much.
ABSURD_VS_RAW_TCP = 10.0
COST_PUSHES = 40  # /proc counts the receiver in 10 ms ticks: 10 tiny pushes read 0 once
# Steps with pushes over steps without: no real run comes near this in either direction.
ABSURD_STEP_RATIO = 10.0


class _Recorder:
    """Wraps the benchmark's baselines and its PeerClient to see what they really moved."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, list[tuple[float, int]]] = {}  # name -> (wall s, bytes asked)
        self.pushes: list[tuple[float, int, list[int]]] = []  # (wall s, bytes, merged segs)
        self.pulls: list[dict[int, torch.Tensor]] = []
        for name, size in [
            ("bench_raw_tcp", lambda payload, reps: len(payload)),
            ("bench_gloo", lambda numel, reps: numel * 4),
            ("bench_grpc_bare", lambda nbytes, reps: nbytes),
            ("bench_gossipd", lambda numel, *rest: numel * 4),
        ]:
            run = getattr(transport_cli, name)
            monkeypatch.setattr(transport_cli, name, self._timed(name, run, size))
        recorder = self

        class RecordingClient(PeerClient):
            async def push(self, out: OutboundPush, *args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                acks = await super().push(out, *args, **kwargs)
                nbytes = sum(out.snapshot[s].numel() * 4 for s in out.push.weights)
                merged = sorted(a.segment for a in acks if not a.duplicate)
                recorder.pushes.append((time.perf_counter() - t0, nbytes, merged))
                return acks

            async def pull(self, *args: Any, **kwargs: Any) -> Any:
                model = await super().pull(*args, **kwargs)
                recorder.pulls.append({i: v.clone() for i, v in model.values.items()})
                return model

        monkeypatch.setattr(transport, "PeerClient", RecordingClient)

    def _timed(self, name: str, run: Any, size: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            self.calls.setdefault(name, []).append((time.perf_counter() - t0, size(*args)))
            return out

        return timed


def test_bench_transport_moves_the_whole_model_and_its_table_adds_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the numbers must satisfy whatever the machine's speed: every method moved the
    model's bytes, the pull brought back the receiver's model, no timed interval is longer
    than the call it was timed in, and every derived column is computed from the others."""
    recorder = _Recorder(monkeypatch)
    png = tmp_path / "transport.png"
    argv = ["--size-mb", str(MODEL_MB), "--reps", str(REPS), "--quick", "--skip-hivemind"]
    argv += ["--push-cost-pushes", str(COST_PUSHES)]
    assert transport.main([*argv, "--json", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    lines = captured.err.splitlines()

    _check_what_ran(result)
    _check_bytes_moved(recorder)
    _check_times(result["rows"], recorder)
    _check_derived_columns(result, lines)
    _check_table_and_plot(result["rows"], lines, png)
    _check_push_cost(result["push_cost"], lines)


def _rows(rows: list[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["method"] == method]


def _check_what_ran(result: dict[str, Any]) -> None:
    """Every baseline (none fell over into a note), then plaintext and mutual TLS, each
    with two push settings and one pull, each on the bulk lane and then in gRPC frames."""

    def mode(tls: bool) -> list[str]:
        lane, framed = (" (mTLS)", " (mTLS, frames)") if tls else ("", " (frames)")
        return [
            *(f"gossipd {m}{lane}" for m in ("push", "pull")),
            *(f"gossipd {m}{framed}" for m in ("push", "pull")),
            f"gossipd push{lane}",
            f"gossipd push{framed}",
        ]

    rows = result["rows"]
    baselines = ["raw TCP", "gloo", "grpc.aio bare"]
    assert [r["method"] for r in rows] == [*baselines, *mode(False), *mode(True)]
    assert result["notes"] == ["hivemind: skipped (--skip-hivemind)"]
    settings = [
        "segment 16 MiB, chunk 1024 KiB, streams 1 (1 segments)",
        "segment 16 MiB, chunk 1024 KiB, streams 4 (1 segments)",
    ]
    pushes, tls_pushes = _rows(rows, "gossipd push"), _rows(rows, "gossipd push (mTLS)")
    assert [r["settings"] for r in pushes] == [r["settings"] for r in tls_pushes] == settings
    assert (result["model_bytes"], result["tensor_bytes"], result["reps"]) == (
        MODEL_BYTES,
        4 << 20,
        REPS,
    )


def _check_bytes_moved(recorder: _Recorder) -> None:
    """Each baseline was asked for the model's size (raw TCP first and last), each push
    carried the whole snapshot and had every segment merged, the pull returned the
    receiver's model."""
    nbytes = MODEL_BYTES
    for name in ("bench_gloo", "bench_grpc_bare", "bench_gossipd"):
        assert [size for _, size in recorder.calls[name]] == [nbytes], name
    assert [size for _, size in recorder.calls["bench_raw_tcp"]] == [nbytes, nbytes]
    # Per TLS mode, setting and path, a warm-up push, then REPS; per mode and path, a
    # warm-up pull and REPS.
    assert len(recorder.pushes) == 8 * (REPS + 1)
    assert all(size == nbytes and merged == [0] for _, size, merged in recorder.pushes)
    assert len(recorder.pulls) == 4 * (REPS + 1)
    receiver = transport.FlatModel(
        transport.bench_job(transport._job_spec(nbytes // 4, (4 << 20) // 4, seed=1)).model,
        16 << 20,
    )
    for pulled in recorder.pulls:
        assert sorted(pulled) == [0]
        assert sum(v.numel() * 4 for v in pulled.values()) == nbytes
        assert torch.equal(pulled[0], receiver.buffers[0])  # pushes of weight 0 merge nothing


def _check_times(rows: list[dict[str, Any]], recorder: _Recorder) -> None:
    """REPS times per row (raw TCP: REPS at each end), each inside the call that took it."""
    for r in rows:
        reps = 2 * REPS if r["method"] == "raw TCP" else REPS
        assert len(r["times_s"]) == reps and all(0 < t < math.inf for t in r["times_s"]), r
        assert r["nbytes"] == MODEL_BYTES, r
    for method, name in [
        ("raw TCP", "bench_raw_tcp"),
        ("gloo", "bench_gloo"),
        ("grpc.aio bare", "bench_grpc_bare"),
    ]:
        [row] = _rows(rows, method)
        ends = [row["times_s"][i : i + REPS] for i in range(0, len(row["times_s"]), REPS)]
        for times, (wall, _) in zip(ends, recorder.calls[name], strict=True):
            assert sum(times) <= wall, method
    gossipd_times = [t for r in rows if r["method"].startswith("gossipd") for t in r["times_s"]]
    assert sum(gossipd_times) <= recorder.calls["bench_gossipd"][0][0]
    # Pushes went per setting and path, REPS + 1 rounds of a plaintext then an mTLS push;
    # the rows list the plaintext ones first.
    walls = [wall for wall, _, _ in recorder.pushes]
    rounds = [walls[i : i + 2 * (REPS + 1)] for i in range(0, len(walls), 2 * (REPS + 1))]
    own = [r[mode + 2 :: 2] for mode in (0, 1) for r in rounds]  # warm-ups left out
    push_rows = [r for r in rows if r["method"].startswith("gossipd push")]
    for r, mine in zip(push_rows, own, strict=True):
        assert all(t >= w for t, w in zip(r["times_s"], mine, strict=True)), (r, mine)


def _check_derived_columns(result: dict[str, Any], lines: list[str]) -> None:
    """Rates and ratios from each row's own times and the raw TCP row; the summary's best
    push, its ratios and the per-setting mTLS lines from those."""
    rows = result["rows"]
    raw = rows[0]
    for r in rows:
        rates = [MODEL_BYTES / t / 1e9 for t in r["times_s"]]
        assert r["gbps_best"] == pytest.approx(max(rates), rel=1e-12)
        assert r["gbps_median"] == pytest.approx(statistics.median(rates), rel=1e-12)
        assert r["gbps_median"] <= r["gbps_best"] < MAX_PLAUSIBLE_GBPS, r
        assert r["ratio_vs_raw_tcp"] == pytest.approx(r["gbps_best"] / raw["gbps_best"], rel=1e-12)
    assert raw["ratio_vs_raw_tcp"] == 1.0
    pushes, tls_pushes = _rows(rows, "gossipd push"), _rows(rows, "gossipd push (mTLS)")
    best = max(pushes, key=lambda r: r["gbps_best"])
    assert result["best_push_settings"] == best["settings"]
    assert result["ratio_vs_raw_tcp"] == best["ratio_vs_raw_tcp"]
    assert result["ratio_vs_raw_tcp"] < ABSURD_VS_RAW_TCP
    [bare] = _rows(rows, "grpc.aio bare")
    assert result["ratio_vs_grpc_aio_bare"] == pytest.approx(
        best["gbps_best"] / bare["gbps_best"], rel=1e-12
    )
    assert result["gbps"] == {
        m.replace(" ", "_"): max(r["gbps_best"] for r in rows if r["method"] == m)
        for m in {r["method"] for r in rows}
    }
    assert result["machine"]["cpu_count"] == os.cpu_count()
    mtls_lines = [x for x in lines if x.startswith("mTLS push: ")]
    assert mtls_lines == [
        f"mTLS push: {tls['gbps_best'] / plain['gbps_best']:.2f} x plaintext push "
        f"({plain['settings']})"
        for plain, tls in zip(pushes, tls_pushes, strict=True)
    ]


def _check_table_and_plot(rows: list[dict[str, Any]], lines: list[str], png: Path) -> None:
    """The table a person reads (stderr under --json) shows the same rows, in order; the
    plot is a PNG of one bar per row (9 in wide, 0.6 in per row + 1.5 in, at 120 dpi)."""
    table = lines[lines.index(next(x for x in lines if x.startswith("---"))) + 1 :][: len(rows)]
    for line, r in zip(table, rows, strict=True):
        cells = line.split()
        assert line.startswith(r["method"]) and r["settings"] in line, (line, r)
        assert cells[-3:] == [
            f"{r['gbps_best']:.2f}",
            f"{r['gbps_median']:.2f}",
            f"{r['ratio_vs_raw_tcp']:.2f}",
        ], line
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (9 * 120, round((0.6 * len(rows) + 1.5) * 120))


def _check_push_cost(costs: list[dict[str, Any]], lines: list[str]) -> None:
    """The per-push cost rows: plaintext then mTLS, each side's CPU positive and no more
    than every core busy for the whole run could give, the median latency below the p90,
    and the table under the goodput table showing the same numbers."""
    assert [(c["mtls"], c["pushes"], c["payload_bytes"]) for c in costs] == [
        (False, COST_PUSHES, 4096),
        (True, COST_PUSHES, 4096),
    ]
    cores = os.cpu_count() or 1
    for c in costs:
        wall_ms = COST_PUSHES / c["pushes_per_s"] * 1e3
        # /proc counts the receiver in clock ticks: its reading may be one tick over.
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
        assert 0 < c["sender_cpu_ms"] * COST_PUSHES <= wall_ms * cores + tick_ms, c
        assert 0 < c["receiver_cpu_ms"] * COST_PUSHES <= wall_ms * cores + 2 * tick_ms, c
        assert 0 < c["latency_ms_median"] <= c["latency_ms_p90"] < math.inf, c
    head = next(i for i, line in enumerate(lines) if line.startswith("per-push fixed cost"))
    assert lines[head + 1].startswith("---")
    for line, c in zip(lines[head + 2 : head + 4], costs, strict=True):
        label = "4 KiB, mTLS" if c["mtls"] else "4 KiB, plaintext"
        assert line.startswith(label), line
        assert line[len(label) :].replace(",", " ").split() == [
            f"{c['sender_cpu_ms']:.2f}",
            f"{c['receiver_cpu_ms']:.2f}",
            f"{c['latency_ms_median']:.2f}",
            f"{c['latency_ms_p90']:.2f}",
            f"{c['pushes_per_s']:.0f}",
        ], line


def test_trainer_mode_trains_both_runs_the_same_time_and_only_the_second_pushes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--trainer` on digits for 2 s: both runs trained on every node, the run without
    pushes sent no byte, each push carried the whole model, no weight was lost or made
    (the sum over the nodes is the same after both runs), and the table shows the row.
    Both daemons run at the ``--cpu-share`` given (the budget it sets is in the row)."""
    argv = ["--trainer", "--trainer-jobs", "digits", "--duration-s", "2", "--json"]
    argv += ["--cpu-share", "0.5"]
    assert transport.main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    [row] = result["trainer_overhead"]
    assert row["cpu_share"] == 0.5
    assert "gossip.cpu_share 0.5" in captured.err
    params = trainer_overhead.parameter_count("digits")
    assert (row["job"], row["params"], row["model_bytes"]) == ("digits", params, params * 4)
    assert (row["nodes"], row["duration_s"]) == (2, 2.0)
    off, on = row["runs"]
    assert (off["push_probability"], on["push_probability"]) == (0.0, 0.5)
    for run in (off, on):
        assert len(run["steps"]) == 2 and min(run["steps"]) > 0, run
        pairs = zip(run["bytes_sent"], run["pushes"], strict=True)
        assert all(nbytes >= pushes * params * 4 for nbytes, pushes in pairs), run
    assert off["pushes"] == off["bytes_sent"] == [0, 0]
    assert sum(on["mean_weights"]) == pytest.approx(sum(off["mean_weights"]), abs=1e-6)
    assert sum(off["mean_weights"]) == pytest.approx(2.0, abs=1e-6)
    assert (row["steps_off"], row["steps_on"]) == (sum(off["steps"]), sum(on["steps"]))
    assert row["ratio_on_off"] == row["steps_on"] / row["steps_off"]
    # Printed, never asserted as a speed; only a bound no real run comes near (one 3 s run
    # on a loaded machine measured 3.0, the busy neighbours slowing the first run).
    assert 0 < row["ratio_on_off"] < ABSURD_STEP_RATIO
    assert row["pushes_sent"] == sum(on["pushes"])
    assert row["mb_sent_per_node"] == sum(on["bytes_sent"]) / 2 / 1e6
    if "gossip_cpu_share" in row:
        assert 0.0 <= row["gossip_cpu_share"] <= 1.0
    assert result["machine"]["cpu_count"] == os.cpu_count()
    [line] = [x for x in captured.err.splitlines() if x.startswith("digits ")]
    push_ms = row["push_ms_median"]
    assert push_ms is not None and push_ms > 0, "pushes settled, so their median is known"
    assert line.split()[2:9] == [
        f"{row['step_ms_off']:.2f}",
        str(row["steps_off"]),
        str(row["steps_on"]),
        f"{row['ratio_on_off']:.2f}",
        str(row["pushes_sent"]),
        f"{push_ms:.1f}",
        f"{row['mb_sent_per_node']:.1f}",
    ], line


def test_wide_digits_is_the_digits_job_with_a_4_35m_parameter_mlp_and_256_batches() -> None:
    job = build_job(JobSpec(trainer_overhead.WIDE_JOB, seed=3, num_shards=2))
    sizes = [tuple(p.shape) for p in job.model.parameters()]
    assert sizes == [(2048, 64), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]
    assert trainer_overhead.parameter_count(trainer_overhead.WIDE_JOB) == 4_349_962
    assert job.batch_size == 256
    digits = build_job(JobSpec("digits", seed=3, num_shards=2))
    assert list(job.sample_ids) == list(digits.sample_ids)  # the same shard of the same data
    with pytest.raises(JobError, match="has its own model; drop the option model='cnn'"):
        build_job(JobSpec(trainer_overhead.WIDE_JOB, options={"model": "cnn"}))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--trainer", "--size-mb", "8"], "--size-mb: only for the goodput mode"),
        (["--trainer", "--quick", "--no-push-cost"], "--quick, --no-push-cost: only for the"),
        (["--duration-s", "3"], "--duration-s: only with --trainer"),
        (["--trainer", "--duration-s", "0"], "--duration-s 0.0: give a positive number"),
        (["--push-cost-pushes", "5"], "--push-cost-pushes '5': give a whole number of at least"),
        (["--trainer", "--trainer-jobs", ","], "--trainer-jobs ',' names no job"),
        (["--cpu-share", "0.05"], "--cpu-share: only with --trainer"),
        (["--trainer", "--cpu-share", "0"], "--cpu-share '0': give a share of the cores' time"),
        (["--trainer", "--cpu-share", "1.5"], "--cpu-share '1.5': give a share"),
    ],
)
def test_a_flag_the_mode_does_not_use_is_refused_not_ignored(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        transport.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_an_unknown_trainer_job_fails_before_any_daemon_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert transport.main(["--trainer", "--trainer-jobs", "digits,no_such_job"]) == 1
    captured = capsys.readouterr()
    assert "gossipd bench transport: unknown job 'no_such_job'" in captured.err
    assert "trainer overhead:" not in captured.out + captured.err  # not even digits' run began
