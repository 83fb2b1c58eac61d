"""Read a checkpoint's weight files into the page cache while the workers start.

A worker reads its first weight only after its process has started and imported torch and
set up CUDA: seconds (8 s for llama-8b on the GPU machine). On a cold disk the reads then
add their own seconds. The scheduler actor reads the files meanwhile, when the workers'
placement puts one on its node, so the workers load them from memory. Nothing is kept: the
page cache holds the pages, and a file the cache cannot hold is not read.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading

from engine_actors.checkpoint import weight_files

CHUNK = 16 << 20
READERS = 4  # files read at once: a fast disk serves several streams faster than one


def available_memory() -> int:
    """Bytes this process can still fill: MemAvailable of /proc/meminfo, or less what its
    memory cgroup has left (a container sees the host's /proc/meminfo); 0 where unknown."""
    free = _meminfo("MemAvailable")
    left = _cgroup_left()
    return free if left is None else min(free, left)


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cgroup_dirs() -> list[tuple[str, str, str, str]]:
    """(directory, limit file, usage file, memory.stat key of reclaimable page cache) of this
    process's memory cgroup, v2 then v1, its own path first, then the mount's root."""
    own = {"v2": "", "v1": ""}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    own["v2"] = path
                elif "memory" in controllers.split(","):
                    own["v1"] = path
    except (OSError, ValueError):
        pass
    v2, v1 = "/sys/fs/cgroup", "/sys/fs/cgroup/memory"
    return [(v2 + own["v2"], "memory.max", "memory.current", "inactive_file"),
            (v2, "memory.max", "memory.current", "inactive_file"),
            (v1 + own["v1"], "memory.limit_in_bytes", "memory.usage_in_bytes",
             "total_inactive_file"),
            (v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")]


def _cgroup_left(dirs=None) -> int | None:
    """The cgroup's limit less what it uses (reclaimable page cache not counted), or None
    without a limit."""
    for directory, limit_file, usage_file, inactive_key in dirs or _cgroup_dirs():
        try:
            with open(os.path.join(directory, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(directory, usage_file)) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for none
            continue
        return max(0, int(limit) - usage + _stat(directory, inactive_key))
    return None


def _stat(directory: str, key: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def prefetch(path: str, stop: threading.Event | None = None
             ) -> concurrent.futures.Future | None:
    """Start reading the checkpoint's safetensors files in background threads; the future
    gives the bytes read. None when there are none, or when they would fill more than half
    of the available memory (the cache would drop them again before the workers read).
    Setting `stop` ends the reads early."""
    files = weight_files(path)
    if not files or sum(map(os.path.getsize, files)) > available_memory() // 2:
        return None
    runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
    future = runner.submit(_read_all, files, stop or threading.Event())
    runner.shutdown(wait=False)
    return future


def _read_all(files: list[str], stop: threading.Event) -> int:
    with concurrent.futures.ThreadPoolExecutor(min(READERS, len(files))) as pool:
        return sum(pool.map(_read, files, [stop] * len(files)))


def _read(file: str, stop: threading.Event) -> int:
    buffer = bytearray(CHUNK)
    done = 0
    with open(file, "rb", buffering=0) as f:
        while not stop.is_set() and (n := f.readinto(buffer)):
            done += n
    return done
