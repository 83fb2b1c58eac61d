"""`orca-serve finetune FILE`: upload a training file, start a fine-tuning job, and with
--wait follow it (a progress bar of steps and loss) until it ends; prints the job id, and
the served `fine_tuned_model` once it succeeds."""
from __future__ import annotations

import os
import sys
import time

from deployments.cli.http import CLIError, Server, check, json_body, server_errors

POLL_S = 0.5


def run_finetune(server: Server, path: str, model: str | None, options: dict, wait: bool,
                 show_progress: bool) -> int:
    if not os.path.isfile(path):
        raise CLIError(f"no such training file: {path}", 2)
    with server_errors(server.url), server.client(60.0) as client:
        if model is None:
            resp = client.get("/v1/models")
            check(resp, "listing the models")
            model = json_body(resp, "listing the models")["data"][0]["id"]
        with open(path, "rb") as f:
            resp = client.post("/v1/files", data={"purpose": "fine-tune"},
                               files={"file": (os.path.basename(path), f)})
        check(resp, "uploading the training file")
        file_id = json_body(resp, "uploading the training file")["id"]
        resp = client.post("/v1/fine_tuning/jobs", json={"training_file": file_id,
                                                         "model": model, **options})
        check(resp, "creating the fine-tuning job")
        job = json_body(resp, "creating the fine-tuning job")
        print(job["id"])
        if not wait:
            print(f"follow it with: orca-serve finetune-status {job['id']}", file=sys.stderr)
            return 0
        job = follow(client, job, show_progress)
    if job["status"] != "succeeded":
        error = (job.get("error") or {}).get("message", "")
        print(f"orca-serve: the job {job['status']}" + (f": {error}" if error else ""),
              file=sys.stderr)
        return 1
    print(job["fine_tuned_model"])
    return 0


def follow(client, job: dict, show_progress: bool) -> dict:
    """Poll the job until it ends, showing steps and the latest loss."""
    from tqdm import tqdm
    bar = tqdm(total=job["total_steps"], unit="step", disable=not show_progress,
               file=sys.stderr)
    try:
        while job["status"] in ("queued", "running"):
            time.sleep(POLL_S)
            resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}")
            check(resp, "reading the job")
            job = json_body(resp, "reading the job")
            if job["steps_done"] > bar.n:
                resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events")
                check(resp, "reading the job's events")
                metrics = [e["data"] for e in json_body(resp, "reading the job's events")["data"]
                           if e.get("data")]
                if metrics:
                    bar.set_postfix(loss=f"{metrics[0]['train_loss']:.4f}")
                bar.update(job["steps_done"] - bar.n)
    finally:
        bar.close()
    return job


def job_status(server: Server, job_id: str, cancel: bool = False) -> int:
    with server_errors(server.url), server.client(30.0) as client:
        resp = (client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel") if cancel
                else client.get(f"/v1/fine_tuning/jobs/{job_id}"))
        check(resp, "cancelling the job" if cancel else "reading the job")
        job = json_body(resp, "reading the job")
    model = f" -> {job['fine_tuned_model']}" if job.get("fine_tuned_model") else ""
    print(f"{job['id']}: {job['status']}, step {job['steps_done']}/{job['total_steps']}, "
          f"{job['trained_tokens']} tokens trained{model}")
    return 0
