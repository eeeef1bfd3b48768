"""Layer 6 — remote devices: the wire protocol (sans-I/O), its TCP and WebSocket shells, the
client engine that streams ops to a compute peer, and the server that hosts local devices.

docs/protocol.md is the exact specification.
"""
