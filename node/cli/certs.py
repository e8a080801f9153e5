"""`gossipd certs`: the mesh CA, the site certificates for mutual TLS and the operator
certificates that sign MQTT control commands, made, issued and shown without loading torch
or gRPC."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _certs_init(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import init_ca

    cert, key = init_ca(args.dir, mesh_id=args.mesh_id, days=args.days)
    print(f"wrote {cert} (mesh CA certificate: copy it to every site)")
    print(f"wrote {key} (CA private key, mode 0600: keep it here, never on a site)")
    print(f"next: issue a certificate per site with: gossipd certs issue NODE_ID --dir {args.dir}")
    return 0


def _certs_issue(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import CA_CERT_FILE, issue

    cert, key = issue(
        args.node_id,
        args.dir,
        days=args.days,
        coordinator=args.coordinator,
        operator=args.operator,
        renew=args.renew,
    )
    if args.operator:
        print(f"wrote {cert} (certificate of operator {args.node_id}: signs control commands)")
        print(f"wrote {key} (its private key, mode 0600: keep it with the operator)")
        print(
            f"next: gossipd control --broker HOST:PORT --mesh-id MESH_ID --cert {cert} "
            f"--key {key} COMMAND"
        )
        return 0
    what = "the mesh coordinator" if args.coordinator else "site"
    print(f"wrote {cert} (certificate of {what} {args.node_id})")
    print(f"wrote {key} (its private key, mode 0600)")
    print(f"next: copy {cert.name}, {key.name} and {CA_CERT_FILE} to {what} {args.node_id}")
    return 0


def _certs_show(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import describe

    info = describe(args.file)
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>11}: {value}")
    return 0


def add_certs_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gossipd.node.shared.certs import CA_DAYS, SITE_DAYS

    certs = sub.add_parser("certs", help="mesh CA and site certificates for mutual TLS")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    p = certs_sub.add_parser("init", help="create the mesh CA: ca.pem (share) and ca.key (keep)")
    p.add_argument(
        "--dir", required=True, type=Path, help="where to write the CA (required; made 0700)"
    )
    p.add_argument("--mesh-id", required=True, help="mesh id named in the CA (required)")
    p.add_argument(
        "--days", type=int, default=CA_DAYS, help="CA validity in days (default: %(default)s)"
    )
    p.set_defaults(func=_certs_init)

    p = certs_sub.add_parser("issue", help="write NODE_ID.pem and NODE_ID.key signed by the CA")
    p.add_argument("node_id", metavar="NODE_ID", help="the site's node_id, as in its config")
    p.add_argument("--dir", required=True, type=Path, help="directory of the CA (required)")
    role = p.add_mutually_exclusive_group()
    role.add_argument(
        "--coordinator",
        action="store_true",
        help="a certificate for the mesh coordinator named NODE_ID, not for a site",
    )
    role.add_argument(
        "--operator",
        action="store_true",
        help="a certificate for the operator named NODE_ID (gossipd certs issue --operator "
        "NAME): it signs MQTT control commands (gossipd control) and cannot serve as a site's",
    )
    p.add_argument(
        "--days", type=int, default=SITE_DAYS, help="validity in days (default: %(default)s)"
    )
    p.add_argument(
        "--renew",
        action="store_true",
        help="replace NODE_ID's existing certificate and key (rotation; then SIGHUP the site); "
        "default: refuse to overwrite them",
    )
    p.set_defaults(func=_certs_issue)

    p = certs_sub.add_parser("show", help="subject, role, node id, validity of a certificate")
    p.add_argument("file", metavar="FILE", type=Path, help="a PEM certificate")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: table)")
    p.set_defaults(func=_certs_show)
