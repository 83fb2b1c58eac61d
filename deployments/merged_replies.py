"""What several data-parallel engines answer, as one answer (deployments/engines.py):
/health, /metrics, a batch's status and its results."""
from __future__ import annotations

import asyncio

SUMMED = ("num_requests", "num_waiting", "num_running", "num_free_blocks",
          "num_blocks", "num_lent_blocks", "num_steps", "num_preemptions")
BATCH_COUNTS = ("num_requests", "num_completed", "num_failed", "num_cancelled")


def engine_health(reply) -> dict:
    """An engine's health, or why it has none (not connected: None; else the error)."""
    if isinstance(reply, dict):
        return reply
    reason = "not connected" if reply is None else f"{type(reply).__name__}: {reply}"
    return {"state": "unavailable", "workers_alive": False, "reason": reason}


def merged_health(stats: list[dict]) -> dict:
    """The engines' health in one: the first engine's (its stores), the counts summed, the
    state "ready" only if every engine's is, the oldest heartbeat; each engine's under
    `engines`."""
    def having(key: str) -> list[dict]:
        return [s for s in stats if key in s]

    merged = {**stats[0], **{k: sum(s[k] for s in having(k)) for k in SUMMED if having(k)}}
    merged["state"] = next((s["state"] for s in stats if s["state"] != "ready"), "ready")
    merged["workers_alive"] = all(s["workers_alive"] for s in stats)
    if having("heartbeat_age_s"):
        merged["heartbeat_age_s"] = max(s["heartbeat_age_s"] for s in having("heartbeat_age_s"))
    blocks = sum(s["num_blocks"] for s in having("num_blocks"))
    if blocks and having("kv_usage"):
        merged["kv_usage"] = sum(s["kv_usage"] * s["num_blocks"] for s in having("kv_usage")) \
            / blocks
    if having("prefix_cache_hit_rate"):
        rates = [s["prefix_cache_hit_rate"] for s in having("prefix_cache_hit_rate")]
        merged["prefix_cache_hit_rate"] = sum(rates) / len(rates)
    merged["data_parallel_size"] = len(stats)
    merged["engines"] = stats
    return merged


def merged_metrics(texts: list[bytes]) -> bytes:
    """Prometheus texts of registries with the same metrics (each engine's, told apart by
    their `engine` label) as one: each metric's HELP and TYPE once, then its samples."""
    families: dict[str, list[list[str]]] = {}  # name -> [header lines, sample lines]
    for text in texts:
        family = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP "):
                family = families.setdefault(line.split()[2], [[], []])
                if family[0]:
                    family = [[], family[1]]  # (its header is kept once)
            if family is None:
                continue
            family[0 if line.startswith("#") else 1].append(line)
    lines = [line for header, samples in families.values() for line in header + samples]
    return ("\n".join(lines) + "\n").encode()


def merged_batch_status(statuses: list[dict]) -> dict | None:
    """A batch's status from its engines' shares (None: no engine has it). The requests
    of a share that is missing (its engine stopped since) count as failed."""
    if not statuses:
        return None
    counts = {k: sum(s[k] for s in statuses) for k in BATCH_COUNTS}
    lost = max(s.get("total", 0) for s in statuses) - counts["num_requests"]
    if lost > 0:
        counts["num_requests"] += lost
        counts["num_failed"] += lost
    states = {s["status"] for s in statuses}
    state = "cancelled" if "cancelled" in states else "in_progress" \
        if "in_progress" in states else "failed" \
        if counts["num_failed"] == counts["num_requests"] else "completed"
    merged = {**statuses[0], **counts, "status": state,
              "created": min(s["created"] for s in statuses)}
    merged.pop("total", None)
    return merged


async def merged_streams(streams: list):
    """The items of several async iterators as they come, until every one has ended (the
    first error ends it all)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as e:
            queue.put_nowait((None, e))
        finally:  # (a stream cancelled from within: its reader must not wait for it)
            queue.put_nowait((end, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
