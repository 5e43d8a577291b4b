"""A mixture of experts in the trainer: the experts each token is routed to (the step's expert load, in
metrics.jsonl) and the router's auxiliary load-balancing loss (`trainer.moe.aux_loss_coef`).

transformers' MoE families (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, ...) name their router module in
`_can_record_outputs["router_logits"]`: a module whose output at `index` is the router's logits, one row
per token of the flattened batch. Forward hooks on those modules keep each MoE layer's logits while the
engine's policy forward runs inside `Routing.record`, and nowhere else: not during the recomputation of
activation checkpointing in the backward pass, the proximal or value forwards, or generation with a
model lent to a co-hosted inference engine. So the model's forward is called as for a dense model (no
`output_router_logits`, no extra outputs), and a dense model has no `Routing` at all.

The experts counted are each token's top-k router logits, as the routers of these families pick them
(a family that adds a bias or groups experts before its top-k would differ: none of those named does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Routed:
    """The router logits of one forward, in layer order, and the tokens that count (padding does not)."""

    tokens: torch.Tensor  # [n * L] bool, flattened as the routers flatten the batch
    top_k: int
    experts: int
    logits: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: [n * L, experts]

    def _layers(self) -> Iterator[torch.Tensor]:
        for layer in self.logits:
            if layer.shape[0] != self.tokens.numel():
                raise RuntimeError(
                    f"a router's logits have {layer.shape[0]} rows for a batch of {self.tokens.numel()} tokens"
                )
            yield layer[self.tokens.to(layer.device)]

    def counts(self) -> torch.Tensor:
        """[layers, experts]: how many of the tokens each expert received in each MoE layer (each token
        goes to `top_k` of them)."""
        with torch.no_grad():
            rows = [
                torch.bincount(layer.topk(self.top_k, dim=-1).indices.flatten(), minlength=self.experts)
                for layer in self._layers()
            ]
        return torch.stack(rows).double().cpu() if rows else torch.zeros(0, self.experts, dtype=torch.float64)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the Switch Transformer (Fedus et al. 2021, eq. 4) with top-k routing,
        per MoE layer and averaged over layers: experts x sum over experts of (share of the routing
        slots it received) x (its mean router probability). 1 when the tokens spread evenly, up to
        experts / top_k when the same top_k experts take every token; differentiable through the
        probabilities."""
        losses = []
        for layer in self._layers():
            if not len(layer):  # no token to balance (an empty micro-batch): zero, in the graph
                losses.append(layer.sum() * 0.0)
                continue
            probs = torch.softmax(layer.float(), dim=-1)
            picked = probs.detach().topk(self.top_k, dim=-1).indices.flatten()
            share = torch.bincount(picked, minlength=self.experts).float() / picked.numel()
            losses.append(self.experts * (share * probs.mean(0)).sum())
        return torch.stack(losses).mean()


class Routing:
    """Forward hooks on a model's routers; `record` keeps what they route during one forward."""

    def __init__(self, routers: list[torch.nn.Module], index: int, experts: int, top_k: int) -> None:
        self.layers, self.index, self.experts, self.top_k = len(routers), index, experts, top_k
        self._recording: Routed | None = None
        self._grad = False
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        routed = self._recording
        if routed is not None:
            logits = output[self.index] if isinstance(output, tuple) else output
            routed.logits.append(logits if self._grad else logits.detach())

    @contextlib.contextmanager
    def record(self, tokens: torch.Tensor, *, grad: bool) -> Iterator[Routed]:
        """The routing of the forward run inside this block, counting the positions of `tokens` ([n, L]
        bool). `grad`: keep the logits differentiable (for the auxiliary loss)."""
        routed = Routed(tokens.flatten(), self.top_k, self.experts)
        self._recording, self._grad = routed, grad
        try:
            yield routed
        finally:
            self._recording = None


def attach(model: Any) -> Routing | None:
    """Hooks on the routers of `model` (an HF causal LM, possibly under PEFT or FSDP2), or None when it
    has none that transformers records: a dense model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorder = getattr(type(base), "_can_record_outputs", None) or {}
    target = getattr(recorder.get("router_logits"), "target_class", None)
    if target is None:
        return None
    routers = [m for m in base.modules() if isinstance(m, target)]
    if not routers:
        return None
    config = base.config
    experts = getattr(routers[0], "num_experts", None) or getattr(config, "num_experts", None)
    experts = experts or config.num_local_experts
    top_k = getattr(routers[0], "top_k", None) or config.num_experts_per_tok
    return Routing(routers, recorder["router_logits"].index, int(experts), int(top_k))


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The step's expert load from `counts` ([layers, experts], every rank's tokens): tokens per expert
    summed over the MoE layers, and each layer's busiest expert over the mean (1: even; `experts`: one
    expert took every token), averaged over the layers and at the worst layer."""
    mean = counts.mean(1).clamp_min(1e-12)
    ratio = counts.max(1).values / mean
    ratio = torch.where(counts.sum(1) > 0, ratio, 1.0)  # a layer that saw no token is not imbalanced
    return {
        **{f"moe/tokens_per_expert/{e}": float(n) for e, n in enumerate(counts.sum(0).tolist())},
        "moe/load_max_over_mean": float(ratio.mean()),
        "moe/load_max_over_mean_max": float(ratio.max()),
    }


def recording(routing: Routing | None, tokens: torch.Tensor, *, grad: bool) -> Any:
    """`routing.record(tokens, grad=grad)`, or for a dense model (None) a block that records nothing."""
    return contextlib.nullcontext() if routing is None else routing.record(tokens, grad=grad)
