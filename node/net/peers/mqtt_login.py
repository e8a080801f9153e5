"""How a node or ``gossipd control`` logs in to the MQTT broker: ``[mqtt]``'s connection
settings with its files read, so a missing password file or certificate is a config
error at start, not a connection failure later."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from gossipd.node.errors import ConfigError
from gossipd.node.shared.config import MqttConfig


@dataclass(frozen=True)
class BrokerLogin:
    """The connection settings of ``[mqtt]``, with its files read: checked before start."""

    host: str
    port: int
    username: str | None
    password: str | None
    tls: ssl.SSLContext | None
    keepalive_s: int

    @classmethod
    def from_config(cls, config: MqttConfig) -> BrokerLogin:
        host, _, port = config.broker.rpartition(":")
        password = config.password
        if config.password_file is not None:
            try:
                password = config.password_file.read_text().splitlines()[0]
            except (OSError, IndexError) as err:
                why = getattr(err, "strerror", None) or "the file is empty"
                raise ConfigError(
                    f"mqtt.password_file = {config.password_file}: cannot read a password: "
                    f"{why}; write the broker password on its first line"
                ) from None
        return cls(
            host.strip("[]"),
            int(port),
            config.username,
            password,
            _tls_context(config) if config.uses_tls else None,
            config.keepalive_s,
        )


def _tls_context(config: MqttConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=str(config.ca) if config.ca else None)
        if config.cert is not None and config.key is not None:
            context.load_cert_chain(str(config.cert), str(config.key))
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(
            f"mqtt.ca/cert/key: cannot load them: {err}; give PEM files this user can read "
            "(ca: the CA that signed the broker's certificate)"
        ) from None
    return context
