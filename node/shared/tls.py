"""Mutual TLS between sites: the certificate names the node, and only the mesh's CA counts.

A site serves and dials with TLS 1.3 and client certificates on one port, for
every RPC (health and reflection included). Who is on the other end is the node
id in their certificate (:func:`gossipd.node.shared.certs.node_id_of`), never what a
message says: the servicer refuses any claim of identity that differs.

Dialing needs a name to check the server's certificate against. A known peer's
is its node id; a seed's or a relayed address's is not known yet, so the first
dial checks the mesh-wide name every site certificate carries
(``gossipd-node``) and membership then proves the node id the peer claims with
a second dial that checks that id. Relayed peers stay candidates until then.

The mesh coordinator serves with ``Credentials(..., coordinator=True)`` (a coordinator
certificate, :mod:`gossipd.node.shared.certs`); nodes dial it expecting
``certs.COORDINATOR_DNS_NAME``, and its callers are sites, named by :meth:`peer_id` as here.

``Credentials`` re-reads the files on :meth:`Credentials.reload` (SIGHUP): the
server hands the new certificate to the next connection through gRPC's
dynamic server credentials, and channels opened afterwards present it too.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gossipd.node.errors import GossipdError
from gossipd.node.shared import certs
from gossipd.node.shared.config import TlsConfig

log = logging.getLogger(__name__)


class IdentityMismatch(GossipdError):
    """A request claims a node id other than the one its certificate names."""


class NotAllowed(GossipdError):
    """A valid certificate for a node id that ``tls.allow`` does not list."""


@dataclass(frozen=True)
class Material:
    ca: bytes
    cert: bytes
    key: bytes
    node_id: str
    not_after: str


class Credentials:
    """This site's TLS files (or plaintext, when ``insecure``), reloadable while serving."""

    def __init__(
        self,
        *,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        allow: frozenset[str] | None = None,
        insecure: bool = False,
        coordinator: bool = False,
    ) -> None:
        self.insecure = insecure
        self.coordinator = coordinator
        self.allow = allow
        self.files = (ca, cert, key)
        self._lock = threading.Lock()
        self._fetched: Material | None = None  # what the server last handed to gRPC
        # Python ssl contexts (server, client) for the bulk lane, and the material they hold.
        self._ssl: tuple[Material, ssl.SSLContext, ssl.SSLContext] | None = None
        self.material: Material | None = None if insecure else self._read()

    @classmethod
    def from_config(cls, tls: TlsConfig) -> Credentials:
        return cls(
            ca=tls.ca,
            cert=tls.cert,
            key=tls.key,
            allow=frozenset(tls.allow) if tls.allow is not None else None,
            insecure=tls.insecure,
        )

    @property
    def node_id(self) -> str | None:
        return self.material.node_id if self.material else None

    def _read(self) -> Material:
        ca, cert, key = self.files
        assert ca is not None and cert is not None and key is not None
        node_id = certs.check_pair(ca, cert, key, coordinator=self.coordinator)
        if node_id is None and self.coordinator:
            raise certs.CertificateError(
                f"{cert} is not a coordinator certificate; issue one with: gossipd certs issue "
                "NAME --coordinator --dir CA_DIR"
            )
        if node_id is None:
            raise certs.CertificateError(f"{cert} names no node id; issue a site certificate")
        info = certs.describe(cert)
        return Material(
            ca.read_bytes(), cert.read_bytes(), key.read_bytes(), node_id, info["not_after"]
        )

    def reload(self, tls: TlsConfig | None = None) -> Material:
        """Read the files again (and, given a new ``[tls]`` section, its paths and
        allow-list); on any problem keep everything as it was and raise why."""
        if self.insecure:
            raise GossipdError("tls.insecure is set: there is no certificate to reload")
        old_files = self.files
        if tls is not None:
            if tls.insecure:
                raise GossipdError("tls.insecure cannot be switched on while running; restart")
            self.files = (tls.ca, tls.cert, tls.key)
        try:
            material = self._read()
            if self.material is not None and material.node_id != self.material.node_id:
                raise certs.CertificateError(
                    f"the new certificate names {material.node_id!r}, this node is "
                    f"{self.material.node_id!r}; issue it for the same node id"
                )
        except BaseException:
            self.files = old_files
            raise
        with self._lock:
            self.material = material
            if tls is not None:
                self.allow = frozenset(tls.allow) if tls.allow is not None else None
        return material

    # -- server -------------------------------------------------------------------------
    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        if self.insecure:
            return server.add_insecure_port(listen)
        assert self.material is not None
        with self._lock:
            self._fetched = self.material
        return server.add_secure_port(
            listen,
            grpc.dynamic_ssl_server_credentials(
                self._server_config(self.material),
                self._fetch,
                require_client_authentication=True,
            ),
        )

    @staticmethod
    def _server_config(material: Material) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)], root_certificates=material.ca
        )

    def _fetch(self) -> Any:
        """Called by gRPC (on its own thread) before each new connection's handshake."""
        with self._lock:
            material = self.material
            if material is None or material is self._fetched:
                return None  # keep what gRPC has
            self._fetched = material
        return self._server_config(material)

    def allows(self, node_id: str) -> bool:
        """Whether ``tls.allow`` admits ``node_id`` (every site of the mesh when unset)."""
        return self.allow is None or node_id in self.allow

    def peer_id(self, context: grpc.aio.ServicerContext) -> str | None:
        """The node id the caller's certificate names (None in plaintext); checks the allow-list."""
        if self.insecure:
            return None
        pem = context.auth_context().get("x509_pem_cert")
        node_id = certs.node_id_of(pem[0]) if pem else None
        if node_id is None:
            raise IdentityMismatch("the client certificate names no node id")
        if not self.allows(node_id):
            raise NotAllowed(
                f"certificate for {node_id!r} is valid but not in tls.allow of this node; "
                "add it there (and send SIGHUP) to admit that site"
            )
        return node_id

    def ssl_context(self, server_side: bool) -> ssl.SSLContext:
        """A Python ``ssl`` context with this site's current certificate (the bulk lane's),
        built once per certificate and shared by every connection. TLS 1.3, a certificate
        of the mesh CA required both ways; the peer's node id is checked by the caller
        against its certificate, not against a host name."""
        with self._lock:
            material = self.material
            assert material is not None, "plaintext has no TLS context"
            if self._ssl is None or self._ssl[0] is not material:
                self._ssl = (
                    material,
                    _ssl_context(material, ssl.PROTOCOL_TLS_SERVER),
                    _ssl_context(material, ssl.PROTOCOL_TLS_CLIENT),
                )
            return self._ssl[1] if server_side else self._ssl[2]

    # -- client -------------------------------------------------------------------------
    def channel(
        self, address: str, options: list[tuple[str, Any]], expected: str | None = None
    ) -> grpc.aio.Channel:
        """A channel to ``address`` whose server must hold a certificate for ``expected``
        (any site of the mesh when None: the caller then proves the id it claims)."""
        if self.insecure:
            return grpc.aio.insecure_channel(address, options=options)
        credentials, checked = self.client(expected)
        return grpc.aio.secure_channel(address, credentials, options=[*options, checked])

    def client(
        self, expected: str | None = None
    ) -> tuple[grpc.ChannelCredentials, tuple[str, str]]:
        """This node's client credentials and the channel option that makes the server
        prove it holds a certificate for ``expected`` (any site of the mesh when None), for
        a channel of either gRPC API."""
        with self._lock:
            material = self.material
        assert material is not None, "plaintext has no client credentials"
        credentials = grpc.ssl_channel_credentials(material.ca, material.key, material.cert)
        return credentials, ("grpc.ssl_target_name_override", expected or certs.MESH_DNS_NAME)


def check_claim(who: str | None, claimed: str, what: str) -> None:
    """Refuse ``claimed`` unless it is the certificate's node id (no check in plaintext)."""
    if who is not None and claimed != who:
        raise IdentityMismatch(
            f"{what} claims to be {claimed!r} but its certificate names {who!r}; "
            "a site may only speak for the node id in its own certificate"
        )


def _ssl_context(material: Material, protocol: int) -> ssl.SSLContext:
    """``ssl`` loads a certificate chain from files only: the material is written to a
    private temporary folder for the moment it takes."""
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = False
    context.load_verify_locations(cadata=material.ca.decode())
    with tempfile.TemporaryDirectory(prefix="gossipd-tls-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(material.cert)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(material.key)
        context.load_cert_chain(cert, key)
    return context
