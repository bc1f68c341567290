"""The OpenAI-compatible HTTP server: an asyncio front end over one engine thread."""

from .app import create_app
from .async_engine import AsyncEngine, EngineError, EngineSnapshot, RequestHandle
from .launch import build_server, serve

__all__ = ["AsyncEngine", "EngineError", "EngineSnapshot", "RequestHandle", "build_server",
           "create_app", "serve"]
