"""Start-up from a checkpoint on disk: seconds until the first answer, and where they go.

    python -m load_tests.bench_startup --model llama-8b --out startup.json

Writes a checkpoint of the model's shape once (random bf16 weights in safetensors shards of
at most 5 GB with an index, the layout transformers saves), then runs each system in a new
process, one after another:
  read          safetensors' load_file of every shard onto the GPU (CPU where none): moving the bytes, nothing
                else (the floor of any loader)
  transformers  AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map="cuda")
  orca-first    `make serve`'s path (deployments.launch) with an empty Triton cache, until
                POST /v1/completions answers: a first start on a new machine
  orca-again    the same with the Triton cache orca-first filled: a restart
Before each run the checkpoint's pages are dropped from the page cache (posix_fadvise), so
every system reads from the disk, unless --warm. Seconds count from the process's launch;
`import` is the child's own import time, and orca's phases are those of its "engine ready"
log line.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from load_tests.report import save_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_BYTES = 5 * 10**9

READ = """
import json, sys, time
t0 = time.monotonic()
import torch
from safetensors.torch import load_file
t1 = time.monotonic()
n = 0
for f in sys.argv[2:]:
    n += sum(t.numel() * t.element_size() for t in load_file(f, device=sys.argv[1]).values())
torch.cuda.is_available() and torch.cuda.synchronize()
print(json.dumps({"import_s": t1 - t0, "load_s": time.monotonic() - t1, "bytes": n}))
"""

TRANSFORMERS = """
import json, sys, time
t0 = time.monotonic()
import torch
from transformers import AutoModelForCausalLM
t1 = time.monotonic()
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16,
                                             device_map=sys.argv[1])
torch.cuda.is_available() and torch.cuda.synchronize()
print(json.dumps({"import_s": t1 - t0, "load_s": time.monotonic() - t1}))
"""


def write_checkpoint(model: str, path: str, device: str) -> None:
    """config.json, the byte tokenizer, and random bf16 weights of the preset `model` in
    safetensors shards with model.safetensors.index.json."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine_actors.checkpoint import (RANDOM_MODELS, load_hf_config, random_weight,
                                          resolve_model_path)
    if model not in RANDOM_MODELS:
        raise SystemExit(f"--model must be one of {sorted(RANDOM_MODELS)}")
    preset = resolve_model_path(model)  # config and tokenizer of the random-weight preset
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(preset):
        if name.endswith((".json", ".jinja")) and name != "orca_random_weights.json":
            with open(os.path.join(preset, name), "rb") as src, \
                    open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(load_hf_config(path))
    shards, shard, size = [], {}, 0
    for name, param in shapes.named_parameters():
        if size and size + param.numel() * 2 > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = random_weight(name, param.shape, device).cpu()
        size += param.numel() * 2
    shards.append(shard)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        for name, t in tensors.items():
            index["weight_map"][name] = file
            index["metadata"]["total_size"] += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def shard_files(path: str) -> list[str]:
    # not checkpoint.weight_files: this script also runs on older trees (startup_ab.sh)
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def drop_page_cache(path: str) -> None:
    """Ask the kernel to forget the checkpoint's cached pages (clean pages of files we can
    open; no root needed)."""
    os.sync()
    for file in shard_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(code: str, *args: str) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["total_s"] = time.monotonic() - t0
    return result


def first_answer(url: str, model: str, deadline: float) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        # a request sent while the engine starts waits for it
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(req, timeout=max(1.0, deadline - time.monotonic())) as r:
                if r.status == 200:
                    return
        time.sleep(0.25)
    raise TimeoutError(f"no answer from {url} in time")


ENGINE_READY = re.compile(r"engine ready: .*started in ([\d.]+) s \((.*)\)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PHASE = re.compile(r"([^,]+?) ([\d.]+) s(?:,\s*|$)")


class LogTail(threading.Thread):
    """Reads a growing log file; keeps each line with the seconds since t0 it was seen."""

    def __init__(self, path: str, t0: float):
        super().__init__(daemon=True)
        self.path, self.t0 = path, t0
        self.lines: list[tuple[float, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        with open(self.path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    self.lines.append((round(time.monotonic() - self.t0, 2),
                                       ANSI.sub("", line.rstrip())[:2000]))
                elif self.done.is_set():
                    return
                else:
                    time.sleep(0.02)


def run_orca(path: str, triton_cache: str, port: int, timeout_s: float) -> dict:
    from load_tests.bench_http import launched
    log = tempfile.mktemp(suffix=".log")
    open(log, "w").close()
    env = {"TRITON_CACHE_DIR": triton_cache}
    t0 = time.monotonic()
    tail = LogTail(log, t0)
    tail.start()
    with launched({"model": path, "served_model_name": "m"}, port=port, server_env=env,
                  log=log):
        first_answer(f"http://127.0.0.1:{port}", "m", t0 + timeout_s)
        total = time.monotonic() - t0
    tail.done.set()
    tail.join()
    os.unlink(log)
    text = "\n".join(line for _, line in tail.lines)
    match = ENGINE_READY.search(text)  # (older trees log no phases)
    phases = {name: float(s) for name, s in PHASE.findall(match.group(2))} if match else {}
    return {"total_s": total, "engine_s": float(match.group(1)) if match else None,
            "phases": phases, "log": [line for line in tail.lines if line[0] <= total + 1]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dir", default=None, help="where the checkpoint is (written if absent)")
    p.add_argument("--systems", default="read,transformers,orca-first,orca-again")
    p.add_argument("--warm", action="store_true", help="keep the page cache between runs")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=480)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    path = args.dir or os.path.join(tempfile.gettempdir(), f"orca-startup-{args.model}")
    result = {"model": args.model, "dir": path, "cold": not args.warm, "systems": {}}
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not shard_files(path):
        t0 = time.monotonic()
        write_checkpoint(args.model, path, device)
        result["write_s"] = time.monotonic() - t0
    result["bytes"] = sum(os.path.getsize(f) for f in shard_files(path))
    triton_cache = tempfile.mkdtemp(prefix="orca-triton-")
    for system in args.systems.split(","):
        if not args.warm:
            drop_page_cache(path)
        if system == "read":
            r = run_child(READ, device, *shard_files(path))
        elif system == "transformers":
            r = run_child(TRANSFORMERS, device, path)
        elif system in ("orca-first", "orca-again"):
            r = run_orca(path, triton_cache, args.port, args.timeout_s)
        else:
            raise SystemExit(f"unknown system {system!r}")
        result["systems"][system] = r
        print(system, json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    print(table(result))
    save_json(args.out, result)
    return result


def table(result: dict) -> str:
    gb = result["bytes"] / 1e9
    lines = [f"{result['model']}: {gb:.1f} GB of safetensors, "
             f"{'cold' if result['cold'] else 'warm'} page cache",
             "| system | seconds to ready | of which |", "| --- | --- | --- |"]
    for name, r in result["systems"].items():
        if r.get("engine_s") is not None:
            detail = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
            detail = f"engine {r['engine_s']:.1f} ({detail})"
        elif "import_s" in r:
            detail = f"import {r['import_s']:.1f}, load {r['load_s']:.1f}"
        else:
            detail = ""
        lines.append(f"| {name} | {r['total_s']:.1f} | {detail} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
