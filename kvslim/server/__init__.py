"""OpenAI-compatible HTTP server over the engine (``kvslim serve``)."""
from .app import ServerState, build_app
from .transport import Handle, serve, start

__all__ = ["Handle", "ServerState", "build_app", "serve", "start"]
