"""The DiLoCo baseline (``gossip.protocol = "diloco"``): H local steps, then one all-reduce
of the pseudo-gradients and an outer Nesterov step, in real gloo process groups.

Like the all-reduce baseline it has no sum-weights; a healthy group holds one shared model
after every outer step, so the sites' checksums agree at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.baselines.diloco import DilocoSite
from gossipd.node.cli.main import build_parser, main
from gossipd.node.errors import ConfigError
from gossipd.node.launch.launcher import run_mesh
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import free_ports
from gossipd.node.shared.config import load_config, parse_config
from tests.conftest import write_config


def site_config(tmp_path: Path, master: str, **diloco: Any) -> Path:
    """A one-site group: the outer step's arithmetic without a second process."""
    config: dict[str, Any] = {
        "mesh_id": "baseline",
        "node_id": "site-0",
        "data_dir": str(tmp_path / "site-0"),
        "progress_interval_s": 0,
        "job": {"name": "synthetic", "seed": 0, "max_steps": 10, "learning_rate": 0.01},
        "gossip": {"protocol": "diloco"},
        "diloco": {"master": master, **diloco},
        "ranks": {"collective_timeout_s": 10.0},
        "tls": {"insecure": True},
    }
    path = tmp_path / "site-0.toml"
    write_config(path, config)
    return path


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_an_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient(tmp_path: Path) -> None:
    """One site, H = 4 of 10 steps: outer steps after steps 4, 8 and 10 (a short last round).
    Each moves the shared model by Nesterov SGD on (shared - local), computed here by hand
    from the local models the site reached; the local model then starts from the shared one.
    """
    master = f"127.0.0.1:{free_ports(1)[0]}"
    site = DilocoSite(load_config(site_config(tmp_path, master, inner_steps=4)))
    shared = flat(site.model)
    reached: list[torch.Tensor] = []
    step = site.job.train_step

    def train_step() -> float:
        loss = step()
        if site.steps + 1 in (4, 8, 10):  # the last inner step of a round
            reached.append(flat(site.model))
        return loss

    site.job.train_step = train_step  # type: ignore[method-assign]
    site.run()
    buffer = torch.zeros_like(shared)
    for local in reached:
        grad = shared - local
        buffer = 0.9 * buffer + grad
        shared = shared - 0.7 * (grad + 0.9 * buffer)
    assert len(reached) == 3
    assert torch.allclose(flat(site.model), shared, atol=1e-6)
    written = json.loads((tmp_path / "site-0" / "summary.json").read_text())
    assert written["protocol"] == "diloco" and written["training_done"] is True
    assert (written["steps"], written["inner_steps"], written["outer_steps"]) == (10, 4, 3)
    assert not torch.distributed.is_initialized()


def test_a_mesh_of_diloco_sites_ends_with_one_model_and_evaluates_at_outer_steps(
    tmp_path: Path,
) -> None:
    """mesh up --protocol diloco --inner-steps 25: two label-skewed digits sites, 110 steps
    (4 rounds of 25 and one of 10), one shared model on both; its history has a line at each
    outer step past a multiple of eval_every_steps (50), and the last step."""
    spec = MeshSpec(
        nodes=2,
        job="digits",
        protocol="diloco",
        protocol_options={"inner_steps": 25},
        insecure=True,
        duration_s=0.0,
        max_steps=110,
        eval_every_steps=50,
        workdir=tmp_path,
        quiet=True,
    )
    result = run_mesh(spec)
    assert result["exit_codes"] == [0, 0], result
    assert result["models_identical"], result
    for i, node in enumerate(result["nodes"]):
        written = json.loads((tmp_path / f"node-{i}" / "summary.json").read_text())
        assert (written["steps"], written["outer_steps"]) == (110, 5)
        assert written["wait_s"] > 0  # the all-reduces were timed
        lines = (tmp_path / f"node-{i}" / "history.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [50, 100, 110]
        assert node["test_accuracy"] >= 0.80, node  # each site holds half the classes


@pytest.mark.parametrize(
    ("diloco", "expected"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_learning_rate": float("nan")}, "outer_learning_rate"),
        ({"outer_steps": 3}, "outer_steps"),
    ],
    ids=["no-inner-steps", "momentum-1", "nan-lr", "unknown-key"],
)
def test_diloco_config_mistakes_are_clear_errors(diloco: dict[str, Any], expected: str) -> None:
    config = {
        "mesh_id": "m",
        "node_id": "a",
        "tls": {"insecure": True},
        "gossip": {"protocol": "diloco"},
        "diloco": {"master": "127.0.0.1:29500", **diloco},
    }
    with pytest.raises(ConfigError, match=expected):
        parse_config(config)


def test_inner_steps_is_only_for_diloco(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mesh", "up", "--protocol", "allreduce", "--inner-steps", "5"]) == 2
    assert "--inner-steps: only for --protocol diloco, not allreduce" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # demo trains gossip only: no baseline, no flag
        build_parser().parse_args(["demo", "--inner-steps", "5"])
