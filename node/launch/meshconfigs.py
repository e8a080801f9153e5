"""What a local mesh writes before it starts a process: each site's TOML config, the
coordinator's, and a throwaway CA with a certificate per site (mutual TLS, unless
``insecure``). A site of a baseline gets its ``[<baseline>]`` section, naming the
rendezvous node-0 hosts, instead of a ``[gossip.<protocol>]`` table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gossipd.node.baselines import BASELINES
from gossipd.node.errors import GossipdError
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.protocols import settings_class
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials

COORDINATOR_ID = "coordinator"
LAUNCHER_ID = "launcher"


def node_toml(
    spec: MeshSpec,
    mesh_id: str,
    index: int,
    ports: list[int],
    root: Path,
    coordinator: str | None = None,
    rendezvous: str | None = None,
) -> str:
    """Site ``index``'s config; ``rendezvous``: HOST:PORT node-0 hosts, for a baseline."""
    addresses = [f"127.0.0.1:{p}" for p in ports]
    seeds = [] if spec.mqtt_broker else [a for i, a in enumerate(addresses) if i != index]
    lines = [
        f'mesh_id = "{mesh_id}"',
        f'node_id = "node-{index}"',
        f'listen = "{addresses[index]}"',
        f"seeds = {json.dumps(seeds)}",
        *([f"coordinator = {json.dumps(coordinator)}"] if coordinator else []),
        f'data_dir = "{root / f"node-{index}"}"',
        *_table("job", _job(spec, index)),
        *_table("job.options", spec.job_options),
        *_gossip_tables(spec, index),
        *_table("membership", {"start_after_peers": spec.nodes - 1}),
        *_table("checkpoint", {"every_steps": spec.checkpoint_every_steps}),
        *_table("link", spec.link[index] if spec.link else {}),
        *(_table("limits", spec.limits) if spec.limits else []),
        "",
        "[tls]",
        *_tls(spec, root, index),
    ]
    if spec.collective_timeout_s is not None:
        lines += _table("ranks", {"collective_timeout_s": spec.collective_timeout_s})
    if spec.mqtt_broker:
        lines += _table("mqtt", {"broker": spec.mqtt_broker})
    if spec.protocol in BASELINES:
        if rendezvous is None:
            raise GossipdError(
                f"node_toml for baseline {spec.protocol!r} without a rendezvous: pass the "
                "HOST:PORT node-0 hosts (LocalMesh picks a free one)"
            )
        lines += _table(spec.protocol, {"master": rendezvous, **spec.protocol_options})
    return "\n".join(lines) + "\n"


def _table(name: str, values: dict[str, Any]) -> list[str]:
    """``[name]`` and its keys, after a blank line."""
    return ["", f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]


def _job(spec: MeshSpec, index: int) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": spec.job,
        "seed": spec.seed + index,
        "shard_index": index,
        "num_shards": spec.nodes,
        "duration_s": spec.duration_s,
        "max_steps": spec.max_steps,
        "eval_every_steps": spec.eval_every_steps,
        "device": spec.device,
    }
    if spec.learning_rate is not None:
        job["learning_rate"] = spec.learning_rate
    if spec.max_steps_per_s:
        job["max_steps_per_s"] = spec.max_steps_per_s
    return job


def _gossip_tables(spec: MeshSpec, index: int) -> list[str]:
    """``[gossip]``, and the protocol's ``[gossip.<protocol>]`` with the settings it has (a
    baseline is no gossip protocol: it has none)."""
    gossip: dict[str, Any] = {"protocol": spec.protocol, "codec": spec.codec, "seed": index}
    if spec.cpu_share is not None:
        gossip["cpu_share"] = spec.cpu_share
    if spec.error_feedback:
        gossip["error_feedback"] = True
    if spec.feedback_peers is not None:
        gossip["feedback_peers"] = spec.feedback_peers
    if spec.protocol in BASELINES:
        return _table("gossip", gossip)
    takes = settings_class(spec.protocol).model_fields
    wanted = {"round_steps": spec.round_steps, "push_probability": spec.push_probability}
    own = {k: v for k, v in wanted.items() if v is not None and k in takes}
    own.update(spec.protocol_options)
    return [*_table("gossip", gossip), *_table(f"gossip.{spec.protocol}", own)]


def _tls(spec: MeshSpec, root: Path, index: int) -> list[str]:
    if spec.insecure:
        return ["insecure = true"]
    tls_dir = root / "tls"
    return [
        f'ca = "{tls_dir / certs.CA_CERT_FILE}"',
        f'cert = "{tls_dir / f"node-{index}.pem"}"',
        f'key = "{tls_dir / f"node-{index}.key"}"',
    ]


def make_mesh_ca(spec: MeshSpec, mesh_id: str, root: Path) -> Credentials:
    """A throwaway CA in the work dir, a certificate per node and one for this launcher,
    so a local mesh runs the way a real one should: mutual TLS (unless ``insecure``)."""
    if spec.insecure:
        return Credentials(insecure=True)
    tls_dir = root / "tls"
    if not (tls_dir / certs.CA_CERT_FILE).exists():
        certs.init_ca(tls_dir, mesh_id=mesh_id)
    for node_id in [LAUNCHER_ID, *(f"node-{i}" for i in range(spec.nodes))]:
        if not (tls_dir / f"{node_id}.pem").exists():
            certs.issue(node_id, tls_dir)
    if spec.coordinator and not (tls_dir / f"{COORDINATOR_ID}.pem").exists():
        certs.issue(COORDINATOR_ID, tls_dir, coordinator=True)
    return Credentials(
        ca=tls_dir / certs.CA_CERT_FILE,
        cert=tls_dir / f"{LAUNCHER_ID}.pem",
        key=tls_dir / f"{LAUNCHER_ID}.key",
    )


def coordinator_toml(mesh_id: str, address: str, root: Path) -> str:
    tls_dir = root / "tls"
    lines = [
        f'mesh_id = "{mesh_id}"',
        f'listen = "{address}"',
        f'data_dir = "{root / COORDINATOR_ID}"',
        "",
        "[tls]",
        f'ca = "{tls_dir / certs.CA_CERT_FILE}"',
        f'cert = "{tls_dir / f"{COORDINATOR_ID}.pem"}"',
        f'key = "{tls_dir / f"{COORDINATOR_ID}.key"}"',
    ]
    return "\n".join(lines) + "\n"
