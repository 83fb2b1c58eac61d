"""`orca-serve finetune FILE`: upload a training file, start a fine-tuning job, and with
--wait follow it (a progress bar of steps and loss) until it ends; prints the job id, and
the served `fine_tuned_model` once it succeeds."""
from __future__ import annotations

import os
import sys
import time

from deployments.cli.batch_input import USAGE_ERROR
from deployments.cli.http import CLIError, Server, check, json_body, server_errors
from deployments.protocol import APIError
from deployments.training_data import read_rows

POLL_S = 0.5


def run_finetune(server: Server, path: str, model: str | None, options: dict, wait: bool,
                 show_progress: bool) -> int:
    if not os.path.isfile(path):
        raise CLIError(f"no such training file: {path}", USAGE_ERROR)
    with open(path, "rb") as f:
        content = f.read()
    try:  # the shape of every line, before anything is sent (the server also tokenizes)
        read_rows(content)
    except APIError as e:
        raise CLIError(f"{path}: {e.message}", USAGE_ERROR) from None
    with server_errors(server.url), server.client(60.0) as client:
        if model is None:
            resp = client.get("/v1/models")
            check(resp, "listing the models")
            model = json_body(resp, "listing the models")["data"][0]["id"]
        resp = client.post("/v1/files", data={"purpose": "fine-tune"},
                           files={"file": (os.path.basename(path), content)})
        check(resp, "uploading the training file")
        file_id = json_body(resp, "uploading the training file")["id"]
        resp = client.post("/v1/fine_tuning/jobs", json={"training_file": file_id,
                                                         "model": model, **options})
        if resp.status_code != 200:  # the file would only take room on the server
            client.delete(f"/v1/files/{file_id}")
        try:
            check(resp, "creating the fine-tuning job")
        except CLIError as e:
            raise CLIError(str(e), USAGE_ERROR if resp.status_code == 400 else e.exit_code) \
                from None
        job = json_body(resp, "creating the fine-tuning job")
        print(job["id"])
        if not wait:
            print(f"follow it with: orca-serve finetune-status {job['id']}", file=sys.stderr)
            return 0
        try:
            job = follow(client, job, show_progress)
        except KeyboardInterrupt:
            print(f"\nstopped following; the job keeps running on the server.\n"
                  f"  status: orca-serve finetune-status {job['id']}\n"
                  f"  stop it: orca-serve finetune-cancel {job['id']}", file=sys.stderr)
            return 130
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
    shown = 0  # steps shown (a disabled bar counts none)
    try:
        while job["status"] in ("queued", "running"):
            time.sleep(POLL_S)
            resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}")
            check(resp, "reading the job")
            job = json_body(resp, "reading the job")
            if job["steps_done"] > shown and show_progress:
                # the newest events: the latest step's loss is among them
                resp = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events",
                                  params={"limit": 10})
                check(resp, "reading the job's events")
                metrics = [e["data"] for e in json_body(resp, "reading the job's events")["data"]
                           if e.get("data")]
                if metrics:
                    bar.set_postfix(loss=f"{metrics[0]['train_loss']:.4f}")
                bar.update(job["steps_done"] - shown)
                shown = job["steps_done"]
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
