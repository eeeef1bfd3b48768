"""Layer 6 — the compute peer: the server that hosts local devices for remote clients (the
client is the remote engine, ``engines/remote.py``; the frames are ``ember.wire``).

docs/protocol.md is the exact specification.
"""
