"""Running the `orca-serve` CLI's main() in-process with its output captured."""
from __future__ import annotations

import io
import sys

from deployments.cli.main import main


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_cli(monkeypatch, *args: str, tty: bool = False, stdin: str | None = None,
            env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    """main(args) with its output captured; `env` (None: unset) and `stdin` for this call."""
    out, err = io.StringIO(), (_TTY() if tty else io.StringIO())
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    if stdin is not None:  # the chat ends at its EOF
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    for name, value in (env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    code = main(list(args))
    monkeypatch.undo()
    return code, out.getvalue(), err.getvalue()
