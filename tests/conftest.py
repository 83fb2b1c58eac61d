from __future__ import annotations

import os

# Before Ray is imported anywhere: local single-machine clusters without token auth.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Serve's settings as `make serve` runs it (HAProxy in front of the ingress replicas)
from deployments import serve_env  # noqa: E402

serve_env.apply()

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton has no CPU backend: its interpreter runs the kernels on CPU tensors (fp32 only;
    # it computes bf16 arithmetic wrongly). Must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def uses_shared_server(item) -> bool:
    """Whether the test takes the session's `url` (not one its module defines)."""
    return "url" in item.fixturenames and not hasattr(item.module, "url")


def pytest_collection_modifyitems(config, items):
    # the tests on the shared server run last, one after another: it starts once, and no
    # other Ray cluster or server of a later test runs beside it (ports, CPUs)
    items.sort(key=uses_shared_server)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def url():
    """serve_config.yaml's application, started once for all the tests that take it (they
    run last: pytest_collection_modifyitems). A module may define its own `url` with other
    args."""
    from tests.serve_fixture import app_config, start_app, stop_app
    base = start_app(app_config())
    yield base
    stop_app()


@pytest.fixture(scope="module")
def client(url):
    """The official openai client on `url` (a test extra)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
