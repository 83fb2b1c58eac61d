"""Optional API key: every route except GET /health, /metrics, /ping and /version needs
`Authorization: Bearer <key>`.

The check runs before routing and lets only those exact (decoded) paths through, so no
path variant (`//v1/completions`, `/V1/...`, percent-encoding) reaches an inference route
without the key: they all get 401. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

OPEN_PATHS = {"/health", "/metrics", "/ping", "/version"}


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._is_open(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = {"error": {"message": "invalid or missing API key (Authorization: Bearer)",
                          "type": "authentication_error", "param": None,
                          "code": "invalid_api_key"}}
        response = JSONResponse(body, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    @staticmethod
    def _is_open(scope) -> bool:
        # the decoded path, as the router sees it, relative to the app's route prefix
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return scope["method"] in ("GET", "HEAD") and path in OPEN_PATHS

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)
