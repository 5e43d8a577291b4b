"""The data plane: a table of rows with named columns shared by every service of a run.

Metadata lives in the controller (`controller.py`), tensor bytes in shared memory on the host that wrote
them (`shm.py`), served to other hosts by that host's storage server (`storage.py`). Services use
`Client` or `AsyncClient`.

Names are imported lazily so that the servers start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncClient": "meshrl.dataplane.aio",
    "AuthError": "meshrl.dataplane.wire",
    "Batch": "meshrl.dataplane.batch",
    "Client": "meshrl.dataplane.client",
    "Controller": "meshrl.dataplane.controller",
    "DataPlaneError": "meshrl.dataplane.client",
    "LeaseExpired": "meshrl.dataplane.client",
    "PartitionFull": "meshrl.dataplane.client",
    "Ragged": "meshrl.dataplane.batch",
    "Storage": "meshrl.dataplane.storage",
    "UnknownPartition": "meshrl.dataplane.client",
    "start_controller": "meshrl.dataplane.serve",
    "start_storage": "meshrl.dataplane.storage",
}

if TYPE_CHECKING:
    from meshrl.dataplane.aio import AsyncClient
    from meshrl.dataplane.batch import Batch, Ragged
    from meshrl.dataplane.client import Client, DataPlaneError, LeaseExpired, PartitionFull, UnknownPartition
    from meshrl.dataplane.controller import Controller
    from meshrl.dataplane.serve import start_controller
    from meshrl.dataplane.storage import Storage, start_storage
    from meshrl.dataplane.wire import AuthError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'meshrl.dataplane' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AuthError",
    "Batch",
    "Client",
    "Controller",
    "DataPlaneError",
    "LeaseExpired",
    "PartitionFull",
    "Ragged",
    "Storage",
    "UnknownPartition",
    "start_controller",
    "start_storage",
]
