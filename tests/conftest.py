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


def server_group(item) -> int:
    """0: no in-process server; 1: a module of its own server (marked `own_server`); 2: the
    session's shared server."""
    if uses_shared_server(item):
        return 2
    return 1 if item.get_closest_marker("own_server") else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # The tests with servers run one module after another, the shared server's last:
    # start_app's Ray and Serve instance stays up from the first to the last of them (a
    # start costs ~12 s). In one process they run last; under pytest-xdist (`make test` runs
    # two workers) they run as one unit in one worker (the largest unit goes first), and
    # every other module runs whole in either worker (its module fixtures once).
    unmarked = sorted({item.module.__name__ for item in items if "url" in item.fixturenames
                       and hasattr(item.module, "url") and not item.get_closest_marker(
                           "own_server")})
    if unmarked:  # it would run beside the other servers, and their ports collide
        raise pytest.UsageError(f"{', '.join(unmarked)} start a server of their own: mark "
                                "them `pytestmark = pytest.mark.own_server`")
    items.sort(key=server_group)
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        item.add_marker(pytest.mark.xdist_group("servers" if server_group(item)
                                                else item.module.__name__))
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test with servers, their Ray and Serve instance ends: a later test of
    this worker may start a Ray cluster of its own."""
    if server_group(item) and (nextitem is None or not server_group(nextitem)):
        from tests.serve_fixture import shutdown
        shutdown()


@pytest.fixture(scope="session", autouse=True)
def serve_instance():
    """Ends the Ray and Serve instance that the server tests shared."""
    yield
    from tests.serve_fixture import shutdown
    shutdown()


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
