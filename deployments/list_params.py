"""The query parameters of OpenAI's paged lists (fine-tuning jobs, their events, files, a
stored response's input items); the page itself is engine_actors.messages.page."""
from __future__ import annotations

from deployments.protocol import APIError


def query_limit(query, default: int = 20, most: int = 100) -> int:
    """A list's `limit` query parameter, as OpenAI's lists take it (APIError 400 outside
    1..most)."""
    raw = query.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit must be an integer from 1 to {most}", "limit",
                       "invalid_value")
    return int(raw)


def query_order(query) -> str:
    """A list's `order` query parameter: "desc" (newest first, the default) or "asc"."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be \"asc\" or \"desc\"", "order", "invalid_value")
    return order
