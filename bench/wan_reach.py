"""NAT as a dimension of `gossipd bench wan`: the last ``--natted K`` sites sit behind the
testbed's NAT router (:mod:`gossipd.bench.wan_nat`) and are reached through relays.

What such a run needs beyond a plain one, kept here so :mod:`gossipd.bench.wan_sites`
stays about starting and timing sites:

* **Certificates.** A relay learns who attaches, dials and takes a connection from each
  stream's certificate (node/net/relay/hub.py); in plaintext there is none, so a natted
  site could never attach. A run with natted sites (or ``--tls``) makes one mesh CA in
  its workdir and a certificate per site, and every site runs mutual TLS.
* **Order.** A natted site asks its seeds at start to dial it back; when no seed answers
  it takes itself as direct and asks again only every 10 s (node/net/peers/reachability.py),
  unreachable meanwhile, which would count against its run's time. So its seeds, the
  public sites only (a natted neighbour on the same private network would dial it back
  and call it reachable), are listening before it starts: :func:`wait_listening`.
* **Loopback.** There is no NAT on 127.0.0.1, so a natted site there is told
  ``reach.reachable = false``: it relays all the same, though nothing stops a dial.
* **Bytes relayed.** Each public site's Status ``relay_bytes`` (what it forwarded as a
  relay, both directions) is read before the sites stop: :func:`relay_bytes`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any

from gossipd.node.errors import GossipdError
from gossipd.node.net.status.query import query_status
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials

log = logging.getLogger(__name__)

CA_DIR = "ca"  # under the bench's workdir, shared by every run of one invocation
HARNESS_ID = "bench-harness"  # the certificate the bench presents to read Status
MESH_ID = "wan-bench"  # names the CA only; each run's sites have their own mesh_id
LISTEN_POLL_S = 0.2
STATUS_S = 10.0


def natted_sites(sites: int, natted: int) -> list[int]:
    """The last ``natted`` of ``sites``: site 0 stays public, the baselines' usual
    rendezvous and the first seed."""
    return list(range(sites - natted, sites))


def ensure_certificates(workdir: Path, sites: int) -> Path:
    """The mesh CA in ``workdir/ca`` with a certificate for each ``site-i`` and the
    harness, made on first use (later runs of the same invocation reuse them)."""
    ca_dir = workdir / CA_DIR
    if not (ca_dir / certs.CA_CERT_FILE).exists():
        ca_dir.mkdir(parents=True, exist_ok=True)
        certs.init_ca(ca_dir, mesh_id=MESH_ID)
    for name in [*(f"site-{i}" for i in range(sites)), HARNESS_ID]:
        if not (ca_dir / f"{name}.pem").exists():
            certs.issue(name, ca_dir)
    return ca_dir


def tls_table(ca_dir: Path | None, node_id: str) -> dict[str, Any]:
    """A site's ``[tls]``: its own certificate under ``ca_dir``, or plaintext without one."""
    if ca_dir is None:
        return {"insecure": True}
    return {
        "ca": str(ca_dir / certs.CA_CERT_FILE),
        "cert": str(ca_dir / f"{node_id}.pem"),
        "key": str(ca_dir / f"{node_id}.key"),
    }


def harness_tls(ca_dir: Path | None) -> Credentials:
    """What the bench presents to a site: the harness's certificate, or plaintext."""
    if ca_dir is None:
        return Credentials(insecure=True)
    return Credentials(
        ca=ca_dir / certs.CA_CERT_FILE,
        cert=ca_dir / f"{HARNESS_ID}.pem",
        key=ca_dir / f"{HARNESS_ID}.key",
    )


def wait_listening(addresses: list[str], timeout_s: float) -> list[str]:
    """Until a TCP connection to each ``HOST:PORT`` opens (from the root namespace, which
    reaches every public site), at most ``timeout_s``; those still not listening."""
    deadline = time.monotonic() + timeout_s
    waiting = list(addresses)
    while waiting and time.monotonic() < deadline:
        waiting = [a for a in waiting if not _listening(a)]
        if waiting:
            time.sleep(LISTEN_POLL_S)
    if waiting:
        log.warning("sites at %s were not listening after %g s", waiting, timeout_s)
    return waiting


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


def relay_bytes(addresses: dict[str, str], tls: Credentials) -> dict[str, int | None]:
    """Each public site's ``relay_bytes`` by node id (None where it did not answer)."""

    async def one(address: str) -> int | None:
        # Asked again until STATUS_S: gRPC's first connect deadline is about 100 ms with
        # the nodes' channel options, which a site busy at the end of its run can miss.
        deadline = time.monotonic() + STATUS_S
        while True:
            try:
                return int((await query_status(address, STATUS_S, tls=tls))["relay_bytes"])
            except GossipdError as err:
                if time.monotonic() > deadline:
                    log.warning("could not read the bytes %s relayed: %s", address, err)
                    return None
            await asyncio.sleep(LISTEN_POLL_S)

    async def every() -> list[int | None]:
        return await asyncio.gather(*(one(a) for a in addresses.values()))

    return dict(zip(addresses, asyncio.run(every()), strict=True))
