"""Optional API key: every route except GET /health, /metrics, /ping and /version needs
`Authorization: Bearer <key>`, or `x-api-key: <key>` (Anthropic's header, which its SDKs
and Claude Code send).

The check runs before routing and lets only those exact (decoded) paths through, so no
path variant (`//v1/completions`, `/V1/...`, percent-encoding) reaches an inference route
without the key: they all get 401. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from deployments.messages_output import error_body

OPEN_PATHS = {"/health", "/metrics", "/ping", "/version"}


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._is_open(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "invalid or missing API key (Authorization: Bearer, or x-api-key)"
        body = error_body(401, message) if self._path(scope).startswith("/v1/messages") else \
            {"error": {"message": message, "type": "authentication_error", "param": None,
                       "code": "invalid_api_key"}}
        response = JSONResponse(body, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    @staticmethod
    def _path(scope) -> str:
        """The decoded path, as the router sees it, relative to the app's route prefix."""
        path, root = scope["path"], scope.get("root_path", "")
        return path[len(root):] if root and path.startswith(root) else path

    def _is_open(self, scope) -> bool:
        return scope["method"] in ("GET", "HEAD") and self._path(scope) in OPEN_PATHS

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        api_key = hmac.compare_digest(b"Bearer " + headers.get(b"x-api-key", b""),
                                      self.expected)
        return bearer | api_key  # (both compared, in constant time)
