"""`gossipd status` and `gossipd health`: a client's questions to a running node, asked
over gRPC with the certificate a site config or --ca/--cert/--key name."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from gossipd.node.errors import GossipdError


def add_query_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``status`` and ``health`` subcommands."""
    p = sub.add_parser(
        "status",
        help="ask a running node (or, with --mesh, every site it knows) what it is doing",
        description="Ask a running node for its step, loss, weights, peers and push counters; "
        "with --mesh, ask every site that node knows at once: the mesh's sum-weight, who holds "
        "it, how far each model is from the mean, and what a restart cost.",
    )
    p.add_argument(
        "--address", required=True, help="HOST:PORT of the node's gRPC server (required)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=5.0,
        help="seconds to wait for the reply (default: %(default)s)",
    )
    p.add_argument(
        "--mesh",
        action="store_true",
        help="every site the node knows, asked at once, with the mesh's sums (default: the "
        "node alone)",
    )
    p.add_argument(
        "--expect-sites",
        type=int,
        default=0,
        metavar="N",
        help="with --mesh: exit 1 unless at least N sites answer and none known is "
        "unreachable (for scripts and alerts; default: exit 0 whenever the node answers)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    _add_client_tls_args(p)
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "health",
        help="the node's gRPC health check: prints SERVING and exits 0, or exits non-zero",
        description="The standard gRPC health check (what a container HEALTHCHECK runs); "
        "copies nothing, unlike status.",
    )
    p.add_argument(
        "--address", required=True, help="HOST:PORT of the node's gRPC server (required)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=3.0, help="seconds to wait (default: %(default)s)"
    )
    _add_client_tls_args(p)
    p.set_defaults(func=_health)


def _add_client_tls_args(p: argparse.ArgumentParser) -> None:
    """The certificate a client command presents (status, health)."""
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="present this site config's [tls] certificate (default: --ca/--cert/--key, "
        "or plaintext when none is given)",
    )
    p.add_argument("--ca", type=Path, default=None, help="the mesh CA certificate (default: none)")
    p.add_argument(
        "--cert", type=Path, default=None, help="a certificate of that mesh (default: none)"
    )
    p.add_argument("--key", type=Path, default=None, help="its private key (default: none)")


def _client_tls(args: argparse.Namespace) -> object:
    """The certificate a command presents: a site config's [tls], or --ca/--cert/--key."""
    from gossipd.node.shared.tls import Credentials

    if args.config is not None:
        from gossipd.node.shared.config import load_config

        return Credentials.from_config(load_config(args.config).tls)
    given = [args.ca, args.cert, args.key]
    if any(given) and not all(given):
        raise GossipdError("--ca, --cert and --key go together; give all three or none")
    if all(given):
        return Credentials(ca=args.ca, cert=args.cert, key=args.key)
    return Credentials(insecure=True)


def _status(args: argparse.Namespace) -> int:
    if args.expect_sites and not args.mesh:
        raise GossipdError("--expect-sites goes with --mesh")
    if args.mesh:
        from gossipd.node.net.status.mesh import query_mesh, render_mesh

        mesh = asyncio.run(query_mesh(args.address, args.timeout_s, tls=_client_tls(args)))
        print(json.dumps(mesh) if args.json else render_mesh(mesh))
        return 0 if len(mesh["sites"]) >= args.expect_sites and not mesh["unreachable"] else 1
    from gossipd.node.net.status.query import query_status, render_status

    # One call by a person or a script: worth the model copy a fresh checksum costs.
    reply = asyncio.run(
        query_status(args.address, args.timeout_s, checksum=True, tls=_client_tls(args))
    )
    print(json.dumps(reply) if args.json else render_status(reply))
    return 0


def _health(args: argparse.Namespace) -> int:
    from gossipd.node.net.status.query import check_health

    status = asyncio.run(check_health(args.address, args.timeout_s, tls=_client_tls(args)))
    print(status)
    return 0 if status == "SERVING" else 1
