"""Certificates for mutual TLS between sites: one CA per mesh, one key and certificate per site.

A mesh trusts exactly one CA (``ca.pem``); its key (``ca.key``) stays with whoever admits
sites and never travels to them. Each site gets ``<node_id>.pem`` and ``<node_id>.key``,
signed by that CA, usable both as a TLS server and as a TLS client, because every site
both dials and is dialed.

A site certificate names two DNS names:

- ``<node_id>``: who the site is. The server reads it from the peer certificate gRPC
  reports (``node_id_of``), so a peer cannot claim another site's id.
- ``gossipd-node`` (``MESH_DNS_NAME``): a name every site shares. A dialer that only has
  an address (a seed, a gossiped advertise address) does not yet know which node it will
  reach, so it checks the server against this name (gRPC channel option
  ``grpc.ssl_target_name_override``) and learns the node id from the certificate. Any
  certificate from the mesh CA passes that check: trust comes from the CA, the node id
  from the certificate.

A coordinator certificate (``issue(..., coordinator=True)``) names only
``gossipd-coordinator`` (``COORDINATOR_DNS_NAME``), its name in the common name. Nodes dial
the coordinator checking that name, so a site certificate cannot pose as the coordinator;
it carries no node id, so the coordinator's certificate cannot pose as a site either.

An operator certificate (``issue(..., operator=True)``) names the operator in its common
name and carries one extended key usage, ``OPERATOR_EKU``, and no DNS name: it signs MQTT
control commands (:mod:`.control_signing`) and cannot serve or dial TLS (no serverAuth or
clientAuth usage) nor name a site. A site certificate lacks that usage, so it cannot sign
a command a node obeys.

Keys are EC P-256, written with mode 0600 from the moment the file exists. Nothing here
shells out to openssl.

This module is what callers import: names and file rules live in :mod:`.cert_files`,
making certificates in :mod:`.cert_issuing`, reading and checking them in
:mod:`.cert_checks`.
"""

from __future__ import annotations

from gossipd.node.shared.cert_checks import (
    check_pair,
    coordinator_name_of,
    describe,
    node_id_of,
    operator_name_of,
)
from gossipd.node.shared.cert_files import (
    CA_CERT_FILE,
    CA_DAYS,
    CA_KEY_FILE,
    CLOCK_SKEW,
    COORDINATOR_DNS_NAME,
    MESH_DNS_NAME,
    NODE_ID_RE,
    OPERATOR_EKU,
    SITE_DAYS,
    CertificateError,
)
from gossipd.node.shared.cert_issuing import init_ca, issue

__all__ = [
    "CA_CERT_FILE",
    "CA_DAYS",
    "CA_KEY_FILE",
    "CLOCK_SKEW",
    "COORDINATOR_DNS_NAME",
    "MESH_DNS_NAME",
    "NODE_ID_RE",
    "OPERATOR_EKU",
    "SITE_DAYS",
    "CertificateError",
    "check_pair",
    "coordinator_name_of",
    "describe",
    "init_ca",
    "issue",
    "node_id_of",
    "operator_name_of",
]
