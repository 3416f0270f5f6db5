"""The OpenAI-compatible server (``specdec serve``): FastAPI app, scheduler, metrics."""
from .app import create_app
from .runner import BackgroundServer, serve

__all__ = ["create_app", "BackgroundServer", "serve"]
