"""The receiving end of the weight group inside vLLM's worker processes (`worker_extension_cls`).

vLLM mixes `WeightReceiver` into its worker class; the inference service drives it with
`collective_rpc("meshrl_...")` (through `VLLMEngine.weight_member`). The worker joins the trainer's
weight group itself, with the same process group the service would have built (`weights_packing.process_group`:
NCCL on GPU, gloo on CPU, under the epoch's store prefix), so the tensors go from the trainer straight
into the worker's model, bucket by bucket: the path vLLM documents for RL. On one host the trainer's
shared memory is mapped here instead. The buckets feed vLLM's in-place reload as they arrive, so one
bucket at a time is held besides the model.

Imported only inside vLLM's workers: nothing here imports vLLM.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrl.runtime.weights_packing import (
    Header,
    broadcast_from_trainer,
    incoming,
    process_group,
    reader,
    span,
)
from meshrl.runtime.weights_shm import SharedWeights


class WeightReceiver:
    """Methods added to vLLM's worker, which provides `device`, `model_runner` and `reload_weights` (vLLM
    refuses an extension naming anything its worker has, hence the `meshrl_` prefix)."""

    device: torch.device
    model_runner: Any
    reload_weights: Any

    def meshrl_join(
        self, host: str, port: int, epoch: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        if getattr(self, "_meshrl_store", None) is None:
            self._meshrl_store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"epoch{epoch}/", self._meshrl_store)
        self._meshrl_pg = process_group(store, rank, world_size, self.device, timeout)

    def meshrl_receive(self, header: Header, tied: bool) -> None:
        if "shm" in header:
            read = reader(self._meshrl_mapped(header["shm"], span(header["buckets"])))
        else:
            read = self._meshrl_broadcast
        self.reload_weights(weights_iterator=(t for bucket in incoming(header, read) for t in bucket))
        self.meshrl_repack_experts()
        if tied:
            self.meshrl_retie()

    def meshrl_repack_experts(self) -> None:
        """After an in-place reload on CPU, a mixture of experts' weights packed again. vLLM's CPU build
        packs them into its grouped-GEMM layout at the first load only: a reload copies the new
        weights, unpacked, into the packed tensors and leaves them so (vLLM 0.32, `_setup_kernel` on a
        weight update), and the experts compute with scrambled weights (measured: logprobs up to 3 nats
        off after one update, exact with this). Dense models have no experts: nothing to do."""
        if self.device.type != "cpu":
            return
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)

    def meshrl_retie(self) -> None:
        """After an in-place reload of a model whose output head is its input embedding: the reload
        post-processes the layers it loaded, but the head shares the weight without being loaded
        itself, so its post-processed form (on CPU a packed copy for the GEMM) still holds the old
        weights; redo it (measured: logprobs stopped following the updates before)."""
        model = self.model_runner.get_model()
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)

    def meshrl_barrier(self) -> None:
        self._meshrl_pg.barrier().wait()

    def meshrl_leave(self) -> None:
        pg, self._meshrl_pg = getattr(self, "_meshrl_pg", None), None
        if pg is not None:
            pg.abort()

    def _meshrl_broadcast(self, size: int) -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        broadcast_from_trainer(self._meshrl_pg, buf)
        return buf

    def _meshrl_mapped(self, name: str, size: int) -> torch.Tensor:
        if getattr(self, "_meshrl_memory", None) is None:
            self._meshrl_memory = SharedWeights(None)  # the slots' mappings, each made once
        return self._meshrl_memory.mapped(name, size)
