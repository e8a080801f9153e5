"""The embedded amqtt broker keeps accepting clients while others subscribe.

amqtt 0.12 loops over its subscriptions with awaits inside; a subscription to a new
topic in the meantime dropped the connecting client without a CONNACK (seen in CI as
a control command's reply timing out). Real clients on a real broker: some keep
subscribing to new topics while others connect and read a retained message.
"""

from __future__ import annotations

import asyncio

import aiomqtt

from gossipd.node.launch.broker import EmbeddedBroker

RETAINED = 20
SUBSCRIBERS, SUBSCRIPTIONS_EACH = 2, 80
CONNECTORS, CONNECTS_EACH = 6, 4
TIMEOUT_S = 20.0


def test_clients_connect_and_get_retained_messages_while_others_subscribe() -> None:
    async def run(port: int) -> list[bytes]:
        async with aiomqtt.Client("127.0.0.1", port, timeout=TIMEOUT_S) as client:
            for i in range(RETAINED):
                await client.publish(f"kept/{i}", f"value {i}".encode(), qos=1, retain=True)

        async def subscriber(k: int) -> None:
            async with aiomqtt.Client("127.0.0.1", port, timeout=TIMEOUT_S) as client:
                for j in range(SUBSCRIPTIONS_EACH):
                    await client.subscribe(f"new/{k}/{j}", qos=1)

        async def connector(i: int) -> list[bytes]:
            topic = f"kept/{i % RETAINED}"
            got = []
            for _ in range(CONNECTS_EACH):
                async with aiomqtt.Client("127.0.0.1", port, timeout=TIMEOUT_S) as client:
                    await client.subscribe(topic, qos=1)
                    async for message in client.messages:
                        if message.topic.matches(topic):
                            got.append(bytes(message.payload or b""))
                            break
            return got

        async with asyncio.timeout(TIMEOUT_S):
            results = await asyncio.gather(
                *(subscriber(k) for k in range(SUBSCRIBERS)),
                *(connector(i) for i in range(CONNECTORS)),
            )
        return [payload for got in results[SUBSCRIBERS:] for payload in got]

    with EmbeddedBroker() as broker:
        payloads = asyncio.run(run(broker.port))
    expected = [
        f"value {i % RETAINED}".encode() for i in range(CONNECTORS) for _ in range(CONNECTS_EACH)
    ]
    assert payloads == expected
