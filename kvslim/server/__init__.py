"""OpenAI-compatible HTTP server over the engine (``kvslim serve``)."""
from .app import KvslimServer, ServerState, start

__all__ = ["KvslimServer", "ServerState", "start"]
