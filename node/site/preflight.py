"""Start-up checks that need neither torch nor the job, run before either loads.

Loading torch and building the job takes seconds on an idle machine and minutes on a
busy one; a wrong certificate path found only after that wastes each attempt of an
operator fixing a config (and each restart of a supervisor). So everything a site's
files decide is checked here first: the config (already parsed), the TLS files, the
ports it will listen on, its data directory (and that the checkpoint there, if any, was
written by this node, mesh, protocol and job) and the package its job's data comes from.
Each failure raises a GossipdError that names the key, the value and the fix; ``gossipd
node`` exits 2 with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from gossipd.node.errors import ConfigError
from gossipd.node.jobs.packages import check_job_package
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.tls import Credentials
from gossipd.node.site.checkpoint_record import SiteIdentity, mismatch_message, read_record


def check_site(config: NodeConfig) -> None:
    """Raise the first start-up mistake in ``config``'s files, ports or data_dir."""
    tls = Credentials.from_config(config.tls)  # reads and checks ca, cert and key
    if tls.node_id not in (None, config.node_id):
        raise ConfigError(
            f"tls.cert {config.tls.cert} is for node {tls.node_id!r}, but node_id is "
            f"{config.node_id!r}; issue one with: gossipd certs issue {config.node_id} "
            "--dir CA_DIR"
        )
    check_port("listen", config.listen)
    if config.metrics.listen:
        check_port("metrics.listen", config.metrics.listen)
    check_data_dir(Path(config.data_dir))
    check_checkpoint_owner(config)
    check_job_package(config.job.name)
    if config.mqtt is not None:
        from gossipd.node.net.peers.mqtt_login import BrokerLogin

        BrokerLogin.from_config(config.mqtt)  # reads mqtt.password_file, ca, cert and key


def check_port(key: str, address: str) -> None:
    """Bind ``address`` once and release it: a port taken or a host not on this machine
    fails now. Port 0 (any free port) cannot be taken and is not probed."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return
    host = host.strip("[]")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As the server binds: a restart finds its port's old connections in TIME_WAIT.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as err:
        raise ConfigError(
            f"{key} = {address!r}: cannot listen there: {err.strerror or err}; stop the process "
            f"that holds the port, pick another port, or use a host address of this machine"
        ) from None


def check_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` if need be and write a probe file into it."""
    probe = data_dir / f".write-probe-{os.getpid()}"  # the ranks of a site share data_dir
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"gossipd")
        probe.unlink()
    except OSError as err:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise ConfigError(
            f"data_dir = {data_dir}: cannot write there: {err.strerror or err}; point data_dir "
            "at a directory this user can write"
        ) from None


def check_checkpoint_owner(config: NodeConfig) -> None:
    """A checkpoint in data_dir whose checkpoint.json names another node_id, mesh_id,
    gossip.protocol or job.name is refused: resuming it would fail inside the restore or
    train on a model that belongs elsewhere. The model's shape is checked after the job
    is built (``checkpoint.load``)."""
    data_dir = Path(config.data_dir)
    record = read_record(data_dir)
    if record is None:
        return
    mismatch = SiteIdentity.of(config).first_mismatch(record.identity)
    if mismatch is not None:
        raise ConfigError(mismatch_message(data_dir, *mismatch))
