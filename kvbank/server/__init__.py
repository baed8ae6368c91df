"""The OpenAI-compatible HTTP server: an asyncio front for the engine and its FastAPI routes."""

from kvbank.server.api import build_app
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.limits import ServerLimits

__all__ = ["AsyncEngine", "ServerLimits", "build_app"]
