"""Ending a local `serve run` whose application cannot start, as vLLM exits: `serve run`
with a config file otherwise keeps running after its application failed (Serve logs the
error and retries nothing useful). The launcher (deployments.launch) prints the cause
last."""
from __future__ import annotations

import logging
import os
import signal
import time

import ray

logger = logging.getLogger("orca_serve.serve_run")
# deployments.launch looks for these in `serve run`'s output
MARK = "stopping `serve run`: the engine failed to start: "
READY = "orca-serve ready: "


def stop_serve_run(cause: str, delay_s: float = 3.0) -> None:
    """Stop the `serve run` process that started this application, if it runs on this node
    (called in a replica, or in the task that builds the application): it exits non-zero
    (Ray's SIGTERM handler), taking its local Ray cluster down. The cause, logged just
    before, reaches its terminal first (Ray forwards workers' logs). Best effort: elsewhere
    (Serve deployed through the dashboard, KubeRay) the application's status says it."""
    try:
        job_id = ray.get_runtime_context().get_job_id()
        node_ip = ray.util.get_node_ip_address()
        jobs = ray._private.worker.global_worker.gcs_client.get_all_job_info()
        driver = next((j for j in jobs.values() if j.job_id.hex() == job_id), None)
        words = driver.entrypoint.split() if driver is not None else []
        if driver is None or driver.is_dead or driver.driver_ip_address != node_ip or \
                not any(w.endswith("serve") or w == "ray.serve.scripts" for w in words) or \
                "run" not in words:
            return
        # once per `serve run`, whichever replica or build comes first: a second SIGTERM
        # would cut Ray's shutdown short and leave its processes (HAProxy) behind
        # (in the Ray session's directory: it goes with the cluster's other files)
        marker = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(),
                              f"orca-serve-stop-{job_id}-{driver.driver_pid}-"
                              f"{driver.start_time}")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        logger.error("orca-serve: %s%s", MARK, cause)
        time.sleep(delay_s)
        os.kill(driver.driver_pid, signal.SIGTERM)
    except Exception:  # best effort
        logger.warning("could not stop `serve run`", exc_info=True)
