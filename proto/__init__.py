"""gossipd's wire schema (``gossip.proto``) and its generated, committed stubs."""

# Peers of different schema versions refuse each other at the handshake, naming both.
# 4: PushOpen.sequence_base (a new numbering per receiver incarnation); 5: PullRequest
# names its segments and round (a schema-4 server would answer with the whole model,
# which a schema-5 puller refuses as segments it did not ask for); 6: pushes travel on a
# long-lived Exchange stream per peer (a schema-5 server has no Exchange).
SCHEMA_VERSION = 6
