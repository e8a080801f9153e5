"""`python -m gossipd.bench.protocols` on a tiny grid, and the relations its table must show.

Not timed: the checks are about rounds and bytes, which the simulator makes
exact and seeded, so they hold on any machine. N = 8, 32, 128 are powers of two,
where the exponential graph averages exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from gossipd.bench import protocols as bench
from gossipd.node.protocols import PROTOCOLS, keeps_weights

SIZES = (8, 32, 128)
TARGET = 1e-3


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    png = tmp_path_factory.mktemp("bench") / "protocols.png"
    argv = [f"--nodes={n}" for n in SIZES] + ["--json", "--plot", str(png)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # module-scoped fixtures cannot use capsys
        assert bench.main(argv) == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert Path(result["plot"]).stat().st_size > 0
    return result


def _rows(table: dict[str, Any], protocol: str) -> list[dict[str, Any]]:
    assert protocol in PROTOCOLS, f"{protocol} is not registered"
    rows = sorted((r for r in table["rows"] if r["protocol"] == protocol), key=lambda r: r["nodes"])
    assert [r["nodes"] for r in rows] == list(SIZES)
    return rows


def test_every_protocol_reaches_the_target_within_the_spectral_bound(table: dict) -> None:
    assert {r["protocol"] for r in table["rows"]} == {p for p in PROTOCOLS if keeps_weights(p)}
    for row in table["rows"]:
        assert row["rounds_to_target"] is not None, row
        assert row["error_end"] <= TARGET
        assert row["bound_held"] is True, row  # rms_k/rms_0 ≤ σ₁(P_k − J) every round
        # homogeneous: a round is 1 s and is measured half a step after it starts
        assert row["virtual_s_to_target"] == pytest.approx(row["rounds_to_target"] + 0.5)


def test_random_protocols_need_more_rounds_for_more_nodes(table: dict) -> None:
    for protocol in ("sumweight", "crossover"):  # _rows fails if one is not registered
        rounds = [r["rounds_to_target"] for r in _rows(table, protocol)]
        assert rounds == sorted(rounds) and rounds[-1] > rounds[0], (protocol, rounds)
        predicted = [r["predicted_rounds_to_target"] for r in _rows(table, protocol)]
        assert predicted == sorted(predicted), (protocol, predicted)


def test_exponential_graph_averages_exactly_in_log2_n_rounds(table: dict) -> None:
    for row in _rows(table, "pushsum-expgraph"):
        log2n = int(math.log2(row["nodes"]))
        assert row["rounds_to_target"] == row["predicted_rounds_to_target"] == log2n
        assert row["error_end"] <= 1e-12  # the product of the log2 N matrices is J
        assert row["models_per_node_per_round"] == 1.0


def test_persyn_burst_averages_exactly(table: dict) -> None:
    for row in _rows(table, "persyn"):
        assert row["error_end"] <= 1e-12
        assert row["rounds_to_target"] <= 2 * int(math.log2(row["nodes"]))


def test_crossover_sends_each_segment_once_per_round(table: dict) -> None:
    for row in _rows(table, "crossover"):
        assert row["models_per_node_per_round"] == 1.0


def test_shuffle_exchange_trades_bytes_for_rounds(table: dict) -> None:
    """Each node sends the whole model to the g − 1 others of its group (k = round(√N)
    near-equal groups): more bytes as N grows, and fewer rounds than one-peer crossover."""
    rows = _rows(table, "shuffle-exchange")
    for row in rows:
        n = row["nodes"]
        k = max(1, round(math.sqrt(n)))
        sizes = [(j + 1) * n // k - j * n // k for j in range(k)]
        assert row["models_per_node_per_round"] == pytest.approx(
            sum(g * (g - 1) for g in sizes) / n
        )
    models = [r["models_per_node_per_round"] for r in rows]
    assert models == sorted(models) and models[-1] > models[0]
    for se, cx in zip(rows, _rows(table, "crossover"), strict=True):
        assert se["rounds_to_target"] < cx["rounds_to_target"], (se, cx)


def test_sumweight_pushes_half_a_model_per_round_on_average(table: dict) -> None:
    for row in _rows(table, "sumweight"):  # push_probability 0.5, half the weight, all of x
        assert 0.4 <= row["models_per_node_per_round"] <= 0.6
