"""``retrospec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the public API.

Layout: ``protocol`` (request validation, response shapes), ``backend`` (loaded models and the single generation
worker), ``metrics`` (Prometheus text), ``app`` (routes, auth, streaming), ``server`` (binding, background runs),
``loadtest`` (a small load generator). The package adds no decoding logic: every request goes through
``retrospec.api.prepare`` and ``retrospec.run.Run`` like any library call.
"""

from .app import build_app, create_app
from .server import BackgroundServer

__all__ = ["create_app", "build_app", "BackgroundServer"]
