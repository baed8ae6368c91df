"""The OpenAI-compatible HTTP server: an asyncio front for the engine and its FastAPI routes."""

from kvbank.server.api import build_app
from kvbank.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
