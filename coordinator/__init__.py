"""The optional coordinator (registry and scheduler host); not yet part of a mesh."""
