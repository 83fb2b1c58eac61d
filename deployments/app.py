"""The application builder that serve_config.yaml names: `deployments.app:build_app`."""
from __future__ import annotations

from ray.serve import Application

from deployments.ingress import OpenAIIngress
from engine_actors.config import EngineConfig


def build_app(args: dict | None = None) -> Application:
    """Validate the application args (a clear error names any bad one) and bind the ingress."""
    cfg = EngineConfig.from_args(args)
    return OpenAIIngress.bind(cfg)
