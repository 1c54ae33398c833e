"""The OpenAI-compatible HTTP layer: request/response models, errors, routes (`create_app`)."""

from serve_app.api.errors import APIError
from serve_app.api.routes import create_app

__all__ = ["APIError", "create_app"]
