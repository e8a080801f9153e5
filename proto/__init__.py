"""gossipd's wire schema (``gossip.proto``) and its generated, committed stubs."""

SCHEMA_VERSION = 4
