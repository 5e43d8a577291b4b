"""Services that share one OS process (the members of a hybrid colocation ring on one device) find each
other here: the trainer hands its live model to inference, and publishes a new version to it by
setting the version (no copy). Filled by `meshrl.runtime.worker` before any service's setup."""

from __future__ import annotations

from typing import Any

_LOCAL: dict[str, Any] = {}  # group id -> the service of that group in this process


def register(services: list[Any]) -> None:
    for s in services:
        _LOCAL[s.ctx.replica.group] = s


def peer(group: str) -> Any | None:
    """The service of `group` running in this process, if any."""
    return _LOCAL.get(group)
