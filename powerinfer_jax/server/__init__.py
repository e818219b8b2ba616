"""The OpenAI-compatible HTTP server (`python -m powerinfer_jax.serve`): app.py (routes),
protocol.py (request/response shapes), worker.py (the engine thread), metrics.py, runner.py."""
from powerinfer_jax.server.app import create_app
from powerinfer_jax.server.runner import Server, ServerThread

__all__ = ["create_app", "Server", "ServerThread"]
