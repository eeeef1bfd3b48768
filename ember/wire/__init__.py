"""Layer 3 — the wire: ember's frames and their codec (sans-I/O, ``protocol``), and the two
framings a peer speaks on one port, TCP (``tcp``) and WebSocket (``websocket``).

Below the engines: the remote engine (a client) and the peer (a server) both speak it, and it
knows nothing of arrays, devices or sessions.
"""
