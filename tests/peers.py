"""Real compute peers for tests: ``ember serve`` subprocesses on 127.0.0.1, a free port each."""

from ember.remote.spawn import PeerProcess as Peer

__all__ = ["Peer"]
