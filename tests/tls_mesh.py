"""A mesh CA for tests and the TLS daemons that use it: certificates per site
(:class:`Pki`), a client that presents certificate files as they are (:class:`FilesTls`,
for the ones ``Credentials`` would refuse), what a server presents, and meshes of daemons
each with its own certificate (:func:`start_tls_mesh`; :func:`insider_mesh_fixtures` for a
test module's mesh with one more member's certificate).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.shared import certs
from gossipd.node.shared.certs import MESH_DNS_NAME
from gossipd.node.shared.tls import Credentials
from tests.conftest import (
    DaemonHandle,
    check_alive,
    start_daemon,
    stop_all,
    wait_mesh_live,
)
from tests.outsider import MESH

CLIENT = "operator"  # the certificate a test presents (Status, CLI)


@dataclass(frozen=True)
class Pki:
    """A mesh CA directory: ``ca.pem``, ``ca.key`` and ``<id>.pem``/``<id>.key`` per site."""

    dir: Path

    @classmethod
    def create(cls, directory: Path, ids: list[str]) -> Pki:
        certs.init_ca(directory, mesh_id=MESH)
        for node_id in ids:
            certs.issue(node_id, directory)
        return cls(directory)

    @property
    def ca(self) -> Path:
        return self.dir / certs.CA_CERT_FILE

    def pem(self, node_id: str) -> Path:
        return self.dir / f"{node_id}.pem"

    def key(self, node_id: str) -> Path:
        return self.dir / f"{node_id}.key"

    def creds(self, node_id: str) -> Credentials:
        return Credentials(ca=self.ca, cert=self.pem(node_id), key=self.key(node_id))

    def tls_config(self, node_id: str, allow: list[str] | None = None) -> dict[str, Any]:
        # conftest's default [tls] is {insecure = true}; it is merged key by key.
        tls: dict[str, Any] = {
            "insecure": False,
            "ca": str(self.ca),
            "cert": str(self.pem(node_id)),
            "key": str(self.key(node_id)),
        }
        if allow is not None:
            tls["allow"] = allow
        return tls


class FilesTls:
    """Presents certificate files as they are, with no check of our own first.

    ``Credentials`` refuses to load an expired certificate or one from another CA
    (``certs.check_pair``); an attacker would not. ``cert``/``key`` None: a TLS
    client with no certificate at all. It trusts ``ca`` for the server.
    """

    def __init__(self, ca: Path, cert: Path | None = None, key: Path | None = None) -> None:
        self.ca = ca.read_bytes()
        self.cert = cert.read_bytes() if cert else None
        self.key = key.read_bytes() if key else None

    def channel(
        self, address: str, options: list[tuple[str, Any]], expected: str | None = None
    ) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        name = expected or MESH_DNS_NAME
        return grpc.aio.secure_channel(
            address, credentials, options=[*options, ("grpc.ssl_target_name_override", name)]
        )


PLAINTEXT = Credentials(insecure=True)


def presented_cert(address: str, pki: Pki, client: str = CLIENT) -> bytes:
    """The DER certificate the server at ``address`` presents to a new TLS connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(pki.ca)
    context.load_cert_chain(pki.pem(client), pki.key(client))
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10.0) as sock,
        context.wrap_socket(sock, server_hostname=MESH_DNS_NAME) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None, f"{address} presented no certificate"
    return der


def der_of(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER
    )


def replace_file(data: bytes, path: Path) -> None:
    """Write ``data`` next to ``path`` under a temporary name, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def start_tls_mesh(
    tmp_path: Path,
    pki: Pki,
    ids: list[str],
    *,
    allow: dict[str, list[str]] | None = None,
    **config: Any,
) -> list[DaemonHandle]:
    """Like conftest's start_mesh, with each node's own certificate (and ``tls.allow``);
    the test presents :data:`CLIENT`'s."""
    allow = allow or {}
    ports = free_ports(len(ids))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    client = pki.creds(CLIENT)

    def start(index: int) -> DaemonHandle:
        node_id = ids[index]
        cfg = dict(config)
        cfg["job"] = {"seed": index, **config.get("job", {})}
        cfg["gossip"] = {"seed": index, **config.get("gossip", {})}
        return start_daemon(
            tmp_path,
            node_id,
            ports[index],
            client_tls=client,
            seeds=[a for i, a in enumerate(addresses) if i != index],
            tls=pki.tls_config(node_id, allow.get(node_id)),
            **cfg,
        )

    handles: list[DaemonHandle] = []
    errors: list[Exception] = []
    with ThreadPoolExecutor(len(ids)) as pool:
        for future in [pool.submit(start, i) for i in range(len(ids))]:
            try:
                handles.append(future.result())
            except Exception as err:
                errors.append(err)
    if errors:
        stop_all(handles)
        raise errors[0]
    try:
        wait_mesh_live(handles, 120.0)
    except BaseException:
        stop_all(handles)
        raise
    return handles


# -- the mesh of tests/test_tls*.py ---------------------------------------------------------

IDS = ["a", "b", "c"]
ATTACKER = "x"  # a valid site certificate of the mesh, used to claim other ids
OTHER_SITE = "z"  # a valid site that is not part of the module mesh at first
# c admits its peers, the site that joins in the ghost test, and the test's client;
# "x" and "intruder" hold valid certificates of the same CA but are not listed.
C_ALLOW = ["a", "b", OTHER_SITE, CLIENT]
CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 1.0, "progress_timeout_s": 2.0},
    "membership": {"anti_entropy_interval_s": 0.5},
}


def module_pki(root: Path) -> Pki:
    """The CA of a TLS test module: a certificate for each of its sites, its client, the
    attacker, the site that joins later and an unlisted "intruder"; an expired one
    ("stale"), a not-yet-valid one ("early"), and another CA for the same mesh id
    (``root/other-ca``) whose "operator" has the right name and the wrong issuer."""
    pki = Pki.create(root / "ca", [*IDS, CLIENT, ATTACKER, OTHER_SITE, "intruder"])
    now = dt.datetime.now(dt.UTC)
    certs.issue("stale", pki.dir, not_before=now - dt.timedelta(days=10), days=1)
    certs.issue("early", pki.dir, not_before=now + dt.timedelta(days=1), days=30)
    Pki.create(root / "other-ca", [CLIENT])
    return pki


@contextlib.contextmanager
def module_mesh(root: Path, pki: Pki) -> Iterator[list[DaemonHandle]]:
    """The three daemons of a TLS test module, gossiping at push probability 1; ``c`` with
    ``tls.allow`` set (:data:`C_ALLOW`). All stopped after."""
    handles = start_tls_mesh(root, pki, IDS, allow={"c": C_ALLOW}, **CONFIG)
    try:
        yield handles
    finally:
        stop_all(handles)


def healthy(mesh: list[DaemonHandle]) -> list[DaemonHandle]:
    """``mesh``, checked whole (a test must not inherit a broken one)."""
    check_alive(mesh)
    wait_mesh_live(mesh, 60.0)
    return mesh


def insider_mesh_fixtures(
    ids: list[str], insider: str, config: dict[str, Any]
) -> tuple[Callable[..., Pki], Callable[..., Iterator[list[DaemonHandle]]]]:
    """A test module's ``pki`` (certificates for ``ids``, :data:`CLIENT` and ``insider``)
    and ``mesh`` (the TLS daemons of ``ids`` with ``config``) fixtures, one per module:
    write ``pki, mesh = insider_mesh_fixtures(IDS, INSIDER, CONFIG)`` at module level."""

    @pytest.fixture(scope="module")
    def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
        return Pki.create(tmp_path_factory.mktemp("pki") / "ca", [*ids, CLIENT, insider])

    @pytest.fixture(scope="module")
    def mesh(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[DaemonHandle]]:
        handles = start_tls_mesh(tmp_path_factory.mktemp("mesh"), pki, ids, **config)
        try:
            yield handles
        finally:
            stop_all(handles)

    return pki, mesh
