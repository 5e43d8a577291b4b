"""The data plane: a table of rows with named columns shared by every service of a run.

Metadata lives in the controller (`controller.py`), tensor bytes in shared memory on the host that wrote
them (`shm.py`), served to other hosts by that host's storage server (`storage.py`). Services use
`Client` or `AsyncClient`.
"""

from meshrl.dataplane.aio import AsyncClient
from meshrl.dataplane.batch import Batch, Ragged
from meshrl.dataplane.client import Client, DataPlaneError, LeaseExpired, PartitionFull, UnknownPartition
from meshrl.dataplane.controller import Controller, start_controller
from meshrl.dataplane.storage import Storage, start_storage
from meshrl.dataplane.wire import AuthError

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
