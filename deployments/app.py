"""The application builder that serve_config.yaml names: `deployments.app:build_app`."""
from __future__ import annotations

import os

from ray.serve import Application

from deployments.chat_protocol import chat_template_text, check_template_kwargs
from deployments.engine_client import start_engine_early
from deployments.ingress import OpenAIIngress
from deployments.llm_configs import from_llm_configs
from deployments.protocol import APIError
from deployments.serve_run_stop import stop_serve_run
from engine_actors.config import ConfigError, EngineConfig


def build_app(args: dict | None = None) -> Application:
    """Validate the application args (a clear error names any bad one), start the engine,
    and bind the ingress.

    The API key may come from the ORCA_SERVE_API_KEY environment variable instead of the
    args (so it need not be written in the config file). Ray Serve LLM's `llm_configs` are
    read as our args (deployments/llm_configs.py)."""
    args = dict(args or {})
    options = {}  # the ingress deployment's, from an LLMConfig's deployment_config
    if "api_key" not in args and os.environ.get("ORCA_SERVE_API_KEY"):
        args["api_key"] = os.environ["ORCA_SERVE_API_KEY"]
    try:
        if "llm_configs" in args:
            args, options = from_llm_configs(args)
        cfg = EngineConfig.from_args(args)
        check_template_kwargs(cfg.default_chat_template_kwargs, "default_chat_template_kwargs")
        if cfg.chat_template is not None:  # its text: replicas may run where the file is not
            cfg = EngineConfig.from_args({**args,
                                          "chat_template": chat_template_text(cfg.chat_template)})
    except (ConfigError, APIError, ValueError) as e:
        cause = f"ConfigError: {getattr(e, 'message', e)}"
        stop_serve_run(cause)  # else `serve run` would go on, its application failed
        raise ConfigError(cause) from None
    start_engine_early(cfg)
    # Serve drains a stopping replica before its shutdown hook runs our own drain: leave
    # room for both before Serve gives up and kills it
    try:
        ingress = OpenAIIngress.options(**{
            "graceful_shutdown_timeout_s": cfg.drain_timeout_s + 15, **options})
    except (TypeError, ValueError) as e:
        cause = f"ConfigError: llm_configs[0].deployment_config: {e}"
        stop_serve_run(cause)
        raise ConfigError(cause) from None
    return ingress.bind(cfg)
