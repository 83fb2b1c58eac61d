"""deployments/kuberay: the RayService manifest and its image stay in step with the repo:
same Ray version as the pinned one, same Serve application as serve_config.yaml, a GPU
worker group, and nothing that exposes the Ray dashboard outside the cluster."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deployments" / "kuberay"


@pytest.fixture(scope="module")
def pinned_ray() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"ray\[serve\]==([\d.]+)", d))]
    assert len(pins) == 1, deps
    return pins[0]


@pytest.fixture(scope="module")
def service() -> dict:
    docs = [d for d in yaml.safe_load_all((KUBERAY / "rayservice.yaml").read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def _containers(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_manifest_is_a_rayservice_on_the_pinned_ray(service, pinned_ray):
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == pinned_ray
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.M)
    assert bases == [f"rayproject/ray:{pinned_ray}-py311-gpu"]
    images = {c["image"] for c in _containers(service)}
    assert len(images) == 1
    image = images.pop()
    assert pinned_ray in image.rsplit(":", 1)[1]  # the tag names the Ray version
    assert f"-t {image} " in dockerfile  # and is what the documented build produces
    assert re.search(r"^RUN pip install [^\n]*\s\.(\s|$)", dockerfile, flags=re.M)


def test_serve_config_is_the_repository_application(service):
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    local = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert config["applications"] == local["applications"]
    ServeDeploySchema.model_validate(config)  # what the dashboard's REST API accepts
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    for c in _containers(service):
        assert 8000 in [p["containerPort"] for p in c["ports"]]


def test_gpu_worker_group_and_string_start_params(service):
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu", 0)
            for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    assert gpus and all(n >= 1 for n in gpus)
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # map[str]str


def test_dashboard_is_not_exposed_beyond_the_cluster(service):
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)
    assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    serve_svc = service["spec"].get("serveService", {})
    assert serve_svc.get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    assert cluster["authOptions"]["mode"] == "token"


def test_every_pod_runs_serve_as_make_serve_does(service):
    """The Serve settings of deployments/serve_env.py (HAProxy in front of the ingress
    replicas) must be in every pod's environment: Serve reads them when Ray starts."""
    from deployments.serve_env import SERVE_ENV
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile, re.M).group(1)
    assert re.search(r"^COPY .*deployments \./deployments$", dockerfile, re.M)
    for c in _containers(service):
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, c["name"]
        # HAProxy through the launcher, as the image holds it (copied to the WORKDIR)
        launcher = env.get("RAY_SERVE_HAPROXY_BINARY_PATH", "")
        assert launcher == f"{workdir}/deployments/haproxy_launcher.py", c["name"]
    assert (REPO / "deployments/haproxy_launcher.py").stat().st_mode & 0o111  # executable
