"""Three daemons with a bulk lane for the bulk-lane tests (``tests/test_bulk_lane*.py``),
what they read back, and the node's own client as one of their members.

Each test module starts its own three, at the same time (:func:`started_daemons`):
``lane`` (plaintext, bulk lane on), ``framed`` (plaintext, ``bulk = false``, the same
model) and ``tls-lane`` (mutual TLS, lane on). Their model is one segment of 1.2 MB.
The plaintext senders are ``FakePeer`` members the daemons verified; the TLS one is a
member with a certificate of the mesh CA (``tests/insider_streams.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.dial.client import BULK_MIN_BYTES, Identity, PeerClient
from gossipd.node.net.wire.frames import Limits
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.protocols.base import Push
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import Ack, OutboundPush, Pulled
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, scrape_metrics, start_daemon, wait_until
from tests.fakepeer import FakePeer
from tests.insider_streams import Insider
from tests.outsider import MESH, pull_unchecked, synthetic_plan
from tests.outsider_tls import handshake_tls
from tests.tls_mesh import CLIENT, Pki

NUMEL = 300_000  # float32 parameters: one segment of 1.2 MB
PLAN = synthetic_plan(numel=NUMEL)
PAYLOAD_BYTES = PLAN.segments[0].nbytes
SENDER, OTHER, MEMBER = "lane-sender", "lane-other", "lane-member"
INCARNATION = 5
IDLE_S = 2.0  # limits.stream_idle_timeout_s of every daemon here
MIN_RATE = 1 << 20  # bytes/s: a whole payload may take IDLE_S + 1.1 s of waiting
TOTAL_CAP = 4  # limits.max_inbound_pushes of the plaintext lane daemon
PER_PEER_CAP = 2  # limits.max_inbound_pushes_per_peer of the TLS daemon
PUSH_TIMEOUT_S = 30.0
TOLERANCE = 1e-12
LIMITS = {
    "stream_idle_timeout_s": IDLE_S,
    "min_push_rate_bytes_s": MIN_RATE,
    "max_sum_weight": 100.0,  # the pushes here add up to more than the founding view of 2
}
JOB = {"options": {"numel": NUMEL}, "max_steps": 1}  # then idle: merges only
PLAINTEXT = Credentials(insecure=True)
PUSH_SEGMENTS = "/gossipd.v1.Gossip/PushSegments"
PULL_MODEL = "/gossipd.v1.Gossip/PullModel"
MERGED = (pb.SEGMENT_RESULT_MERGED,)  # PushOutcome.results of a push merged

assert PAYLOAD_BYTES >= BULK_MIN_BYTES, "the model must be large enough for the lane"


class _Member(Insider):
    """A member of the TLS mesh that runs this file's model; it takes no pushes."""

    def __init__(self, node_id: str, tls: Credentials) -> None:
        super().__init__(node_id, tls, incarnation=INCARNATION)
        self.fingerprint = PLAN.fingerprint  # what its Handshake answers


@dataclass
class Lane:
    """A daemon with a bulk lane, and the verified member that pushes to it."""

    handle: DaemonHandle
    port: int  # the lane's port, from the daemon's Handshake reply
    sender: str
    sender_address: str
    tls: Credentials  # what the member presents on gRPC
    lane_tls: ssl.SSLContext | None  # and on the lane (None: plaintext)

    def client(self, shaper: LinkShaper | None = None) -> PeerClient:
        """The node's own client, as the member (one stream, so one lane connection)."""
        identity = Identity(
            MESH, self.sender, self.sender_address, INCARNATION, PLAN.fingerprint, "sumweight"
        )
        expected = None if self.tls.insecure else self.handle.node_id
        return PeerClient(
            self.handle.address, identity, tls=self.tls, expected=expected, streams=1, shaper=shaper
        )


@dataclass
class Daemons:
    lane: Lane
    framed: Lane  # bulk = false (port 0), the same model and history as lane's
    tls: Lane
    tls_member: _Member
    pki: Pki


# -- the module's daemons -----------------------------------------------------------------


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A TLS client context for raw lane connections (the server checked against ``ca``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the lane names nodes by certificate, not host name
    context.load_verify_locations(ca)
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


def _admitted(handle: DaemonHandle, node_id: str) -> None:
    wait_until(
        lambda: node_id in handle.status()["live_peers"],
        f"{handle.node_id} to verify {node_id}",
        60,
    )


def lane_port(handle: DaemonHandle, tls: Credentials, info: pb.NodeInfo) -> int:
    code, reply, details = handshake_tls(tls, handle.address, info, fingerprint=PLAN.fingerprint)
    assert code == grpc.StatusCode.OK and reply is not None, (code, details)
    return reply.bulk_port


def _start(root: Path, pki: Pki) -> tuple[list[DaemonHandle], list[BaseException | None]]:
    """``lane``, ``framed`` and ``tls-lane``, started at once: those that answered, and what
    each start raised (None where it did not)."""
    ports = free_ports(3)
    plaintext = {"job": JOB, "limits": {**LIMITS, "max_inbound_pushes": TOTAL_CAP}}
    starts: list[Callable[[], DaemonHandle]] = [
        lambda: start_daemon(root, "lane", ports[0], **plaintext),
        lambda: start_daemon(root, "framed", ports[1], bulk=False, **plaintext),
        lambda: start_daemon(
            root,
            "tls-lane",
            ports[2],
            client_tls=pki.creds(CLIENT),
            tls=pki.tls_config("tls-lane"),
            job=JOB,
            limits={**LIMITS, "max_inbound_pushes_per_peer": PER_PEER_CAP},
        ),
    ]
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    handles = [f.result() for f in futures if f.exception() is None]
    return handles, [f.exception() for f in futures]


def _stop(handles: list[DaemonHandle]) -> None:
    with ThreadPoolExecutor(len(handles) or 1) as pool:  # their shutdowns overlap
        stopped = pool.map(DaemonHandle.stop, handles)
        codes = {h.node_id: code for h, code in zip(handles, stopped, strict=True)}
    assert all(code == 0 for code in codes.values()), codes


def _lanes(handles: list[DaemonHandle], pki: Pki, sender: FakePeer, member: _Member) -> Daemons:
    lane, framed, tls = handles
    return Daemons(
        lane=Lane(
            lane,
            lane_port(lane, PLAINTEXT, sender.info()),
            SENDER,
            sender.address,
            PLAINTEXT,
            None,
        ),
        framed=Lane(framed, 0, SENDER, sender.address, PLAINTEXT, None),
        tls=Lane(
            tls,
            lane_port(tls, pki.creds(MEMBER), member.info()),
            MEMBER,
            member.address,
            pki.creds(MEMBER),
            client_context(pki.ca, pki.pem(MEMBER), pki.key(MEMBER)),
        ),
        tls_member=member,
        pki=pki,
    )


@contextlib.contextmanager
def started_daemons(root: Path) -> Iterator[Daemons]:
    """The three daemons of a test module, each with its members verified; all stopped
    after, each exiting 0."""
    pki = Pki.create(root / "ca", ["tls-lane", MEMBER, CLIENT])
    handles, errors = _start(root, pki)
    try:
        assert len(handles) == len(errors), errors
        lane, framed, tls = handles
        with (
            FakePeer(SENDER, fingerprint=PLAN.fingerprint, incarnation=INCARNATION) as sender,
            FakePeer(OTHER, fingerprint=PLAN.fingerprint, incarnation=INCARNATION) as other,
            _Member(MEMBER, pki.creds(MEMBER)) as member,
        ):
            for fake in (sender, other):
                for handle in (lane, framed):
                    fake.introduce_to(handle.address)
                    _admitted(handle, fake.node_id)
            member.introduce_to(tls.address)
            _admitted(tls, MEMBER)
            yield _lanes(handles, pki, sender, member)
    finally:
        _stop(handles)


# -- reading a daemon -----------------------------------------------------------------------


def _metrics(handle: DaemonHandle) -> dict[str, float]:
    return scrape_metrics(handle.node_json()["metrics_port"])


def lane_bytes(handle: DaemonHandle, direction: str) -> float:
    return _metrics(handle).get(f'gossipd_bulk_bytes_total{{direction="{direction}"}}', 0.0)


def lane_connections(handle: DaemonHandle) -> float:
    return _metrics(handle)["gossipd_bulk_connections"]


def no_lane_connections(handle: DaemonHandle) -> None:
    """Until the connections earlier tests left are gone (closed ones are swept in ~1 s)."""
    wait_until(lambda: lane_connections(handle) == 0, "no bulk-lane connections", IDLE_S + 10)


def weight_of(handle: DaemonHandle) -> float:
    return handle.status()["sum_weights"][0]


def rejected(handle: DaemonHandle, reason: str) -> int:
    return handle.status()["rejected"].get(reason, 0)


def counted(handle: DaemonHandle, reason: str, before: int) -> None:
    wait_until(
        lambda: rejected(handle, reason) == before + 1, f"one more {reason} refusal counted", 10
    )


def pull_in_frames(lane: Lane, daemons: Daemons) -> torch.Tensor:
    """The daemon's one segment, pulled in chunk frames (no lane)."""
    if lane.tls.insecure:
        [values] = pull_unchecked(lane.handle.address, fingerprint=PLAN.fingerprint)
    else:
        [values] = daemons.tls_member.pull(lane.handle.address)
    return values


# -- the node's own client ------------------------------------------------------------------

_sequence = itertools.count(2)  # every sender's pushes, numbered once for the process


def next_sequence() -> int:
    """The next push's sequence: one numbering for every sender and daemon, so no two
    pushes of a run share one (daemons take gaps, not repeats)."""
    return next(_sequence)


def seeded_values(seed: int) -> torch.Tensor:
    return 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def outbound_push(sequence: int, weight: float, values: torch.Tensor) -> OutboundPush:
    return OutboundPush(Push("receiver", sequence, {0: weight}), {0: values})


def push_with_client(
    lane: Lane,
    sequence: int,
    weight: float,
    values: torch.Tensor,
    shaper: LinkShaper | None = None,
) -> list[Ack]:
    async def push() -> list[Ack]:
        client = lane.client(shaper)
        try:
            return await client.push(outbound_push(sequence, weight, values), PUSH_TIMEOUT_S)
        finally:
            await client.close()

    return asyncio.run(push())


def pull_with_client(lane: Lane) -> Pulled:
    async def pull() -> Pulled:
        client = lane.client()
        try:
            return await client.pull(PLAN, Limits(), PUSH_TIMEOUT_S)
        finally:
            await client.close()

    return asyncio.run(pull())
