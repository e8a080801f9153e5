"""What a local mesh runs (`gossipd mesh up`, `gossipd demo`, the tests' meshes): one
:class:`MeshSpec`, the same settings for every site of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipd.node.protocols import DEFAULT_PROTOCOL


@dataclass
class MeshSpec:
    nodes: int = 4
    job: str = "digits"
    protocol: str = DEFAULT_PROTOCOL  # a gossip protocol, or a baseline's name
    round_steps: int = 1
    insecure: bool = False
    duration_s: float = 30.0
    max_steps: int = 0
    max_steps_per_s: float = 0.0  # [job] max_steps_per_s of every node; 0: unpaced
    push_probability: float | None = None
    cpu_share: float | None = None  # [gossip] cpu_share of every node; None: the default
    # Node i runs on core i (mod the cores this process may use), as if each site had a
    # machine of its own: its gossip then takes CPU from its own trainer, not a neighbour's.
    pin_cores: bool = False
    codec: str = "raw"
    error_feedback: bool = False  # [gossip] error_feedback of every node (a lossy codec's)
    feedback_peers: int | None = None  # [gossip] feedback_peers of every node; None: default
    learning_rate: float | None = None
    workdir: Path | None = None
    plot_path: Path | None = None
    seed: int = 0
    quiet: bool = False
    sample_interval_s: float = 2.0
    job_options: dict[str, Any] = field(default_factory=dict)
    eval_every_steps: int = 100
    ranks: int = 1  # processes per site (rank 0 gossips; gloo all-reduce inside)
    collective_timeout_s: float | None = None  # [ranks] collective_timeout_s; None: default
    device: str = "cpu"  # job.device of every site (cuda: a GPU per rank)
    checkpoint_every_steps: int = 200
    link: list[dict[str, float]] = field(default_factory=list)  # node i's [link] table, if any
    limits: dict[str, float] = field(default_factory=dict)  # every node's [limits] keys
    # MQTT discovery (`demo --discovery mqtt`): every node's [mqtt] broker, and no seeds.
    mqtt_broker: str | None = None
    # `--coordinator local`: a `gossipd coordinator` process beside the nodes (mutual TLS).
    coordinator: bool = False
    # Keys of [gossip.<protocol>], or of a baseline's own [<name>] section.
    protocol_options: dict[str, Any] = field(default_factory=dict)
