"""The relay's calls (``Attach``, ``Dial``, ``Take``) and the reach check, as served.

Each stream's peer is its connection's certificate, checked against the allow-list as
every other call's; a refusal is counted twice, as any refusal
(``gossipd_rejected_total``) and as a relay's (``gossipd_relay_refused_total``), and
answered with the status its error maps to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from gossipd.node.errors import GossipdError, RelayRefused
from gossipd.node.net.relay.hub import RelayHub
from gossipd.node.net.relay.reach import ReachChecker
from gossipd.node.net.wire.intake import Malformed, parser, require
from gossipd.node.net.wire.statuscodes import status_code
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb

Refused = Callable[[str, GossipdError], None]


async def _checked(frames: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The stream's frames, each parsed (a malformed one ends the call as refused)."""
    async for frame in frames:
        yield require(frame)


def relay_handlers(
    hub: RelayHub, reach: ReachChecker, tls: Credentials, refused: Refused
) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The handlers of the relay's calls, for the servicer's generic handler."""

    def who(context: grpc.aio.ServicerContext[Any, Any]) -> str:
        return tls.peer_id(context) or context.peer()

    async def refuse(context: grpc.aio.ServicerContext[Any, Any], err: GossipdError) -> None:
        if isinstance(err, RelayRefused):
            hub.refused(err)
        refused(context.peer(), err)
        await context.abort(status_code(err), str(err))

    def stream(
        serve: Callable[[str, AsyncIterator[Any]], AsyncIterator[Message]],
    ) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Message]]:
        async def handler(
            frames: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Message]:
            try:
                async for out in serve(who(context), _checked(frames)):
                    yield out
            except GossipdError as err:
                await refuse(context, err)

        return handler

    async def check_reach(
        request: pb.ReachRequest | Malformed, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReachReply:
        try:
            return await reach.check(tls.peer_id(context), require(request))
        except GossipdError as err:
            await refuse(context, err)
            raise  # abort raised already; for the type checker

    def ser(message: Message) -> bytes:
        return message.SerializeToString()

    return {
        "Attach": grpc.stream_stream_rpc_method_handler(
            stream(hub.attach), parser(pb.AttachFrame), ser
        ),
        "Dial": grpc.stream_stream_rpc_method_handler(stream(hub.dial), parser(pb.RelayFrame), ser),
        "Take": grpc.stream_stream_rpc_method_handler(stream(hub.take), parser(pb.RelayFrame), ser),
        "CheckReach": grpc.unary_unary_rpc_method_handler(
            check_reach, parser(pb.ReachRequest), ser
        ),
    }
