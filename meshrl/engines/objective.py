"""What the FSDP engine's optimizer steps minimise, and the metrics they report.

The engine (`fsdp.py`) runs the forwards and the optimizer; this module turns one micro-batch's forward
into its loss. A policy step's loss is the policy loss `loss.policy` and `loss.off_policy` pick (PPO
clip, decoupled PPO, truncated IS or GSPO), minus the entropy bonus, plus the KL to the reference, the
actor-critic's clipped value loss, each teacher's distillation term and a mixture of experts' router
load-balancing loss: the sections of `Objective` (meshrl/engines/settings.py), each taken whole.
`PolicyObjective` assembles it one micro-batch at a time, backpropagates it, and sums the metrics over
the step's micro-batches, each share already normalised by the whole step (every rank's tokens), so the
engine's all-reduce of the sums gives the step's metrics. A critic's step is the value loss alone (`value_terms`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshrl.algorithms.distill import topk_forward_kl
from meshrl.algorithms.losses import (
    PolicyLoss,
    aggregate,
    decoupled_ppo,
    gspo,
    kl,
    ppo_clip,
    tis,
    value_loss,
)
from meshrl.engines.experts import Routed, load_metrics
from meshrl.engines.packing import TrainBatch
from meshrl.engines.settings import DistillConfig, KLLossConfig, LossConfig, MoEConfig, ValueHeadConfig


@dataclass(frozen=True)
class Objective:
    """What a policy step minimises, as the trainer's sections say."""

    loss: LossConfig
    kl: KLLossConfig
    distill: DistillConfig
    value: ValueHeadConfig
    moe: MoEConfig = MoEConfig()


class PolicyObjective:
    """One optimizer step of the policy: each micro-batch's loss, backpropagated as it comes, and the
    step's metrics summed over micro-batches. The counts are over every data-parallel rank: `g_tokens`
    response tokens, `g_rows` rows that have any, `g_n` rows. So each rank's loss is its share of the
    whole batch's, and the gradient wanted is the sum of the ranks' gradients; FSDP averages them, so
    what is backpropagated is the loss times `ranks`. A mixture of experts (`experts`: its MoE layers
    and experts) also sums the tokens each expert received and the routers' auxiliary loss."""

    def __init__(
        self,
        batch: TrainBatch,
        settings: Objective,
        device: torch.device,
        *,
        value_head: bool,
        temperature: float,
        g_tokens: float,
        g_rows: float,
        g_n: float,
        ranks: int = 1,
        experts: tuple[int, int] | None = None,
    ) -> None:
        self.settings, self.device, self.temperature, self.ranks = settings, device, temperature, ranks
        # a step without tokens (every sample failed to score) has loss 0, not 0 / 0
        self.g_tokens, self.g_rows = g_tokens, max(g_rows, 1.0)
        self.normalizer = max(g_tokens if settings.loss.aggregation == "token-mean" else g_n, 1.0)
        keys = ("pg_loss", "entropy", "kl_ref", "kl_behaviour", "clip_fraction", "approx_kl")
        self.sums = dict.fromkeys(keys, 0.0)
        self.sums.update(is_weight_mean=0.0, is_truncated_fraction=0.0)
        if value_head and batch.returns is not None:
            self.sums.update(value_loss=0.0, value_clip_fraction=0.0, values_mean=0.0)
        if batch.teachers:  # forward KL to each teacher's top-k, top-1 agreement, reverse KL
            self.sums["distill_loss"] = 0.0
            for name in sorted(batch.teachers):
                self.sums.update({f"{name}_kl": 0.0, f"{name}_agreement": 0.0, f"{name}_reverse_kl": 0.0})
        if settings.moe.aux_loss_coef > 0 and experts is None:
            raise ValueError("moe.aux_loss_coef: the model is not a mixture of experts (no routers)")
        if experts is not None:  # tokens per (layer, expert): summed over the ranks with the rest
            layers, n = experts
            self.routing_keys = [f"routed/{layer}/{e}" for layer in range(layers) for e in range(n)]
            self.sums.update({"moe/aux_loss": 0.0, **dict.fromkeys(self.routing_keys, 0.0)})
        self.experts = experts
        self.ratio_max = self.is_max = 0.0  # this rank's

    def backward(
        self,
        mb: TrainBatch,
        forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        routed: Routed | None = None,
    ) -> None:
        """Backpropagate the loss of micro-batch `mb` and add its metrics. `forward`: the engine's
        (logprobs, entropy, logits or None, values or None) of it; `mask` its tokens on the engine's
        device; `routed`: a mixture of experts' routing in that forward. The entropy enters the loss only
        with a coefficient: a metric needs no gradient."""
        cfg, sums, tokens = self.settings, self.sums, max(self.g_tokens, 1.0)
        agg = cfg.loss.aggregation
        lp, ent, logits, values = forward
        advantages = mb.advantages.to(self.device)
        out = policy_loss(lp, proximal, behaviour, advantages, mask, cfg.loss, self.normalizer, self.g_rows)
        ent_term = aggregate(ent, mask, agg, self.normalizer)
        loss = out.loss - cfg.loss.entropy_coef * ent_term if cfg.loss.entropy_coef > 0 else out.loss
        if mb.ref_logprobs is not None:
            kl_ref = kl(lp, mb.ref_logprobs.to(self.device), cfg.kl.estimator)
            kl_term = aggregate(kl_ref, mask, agg, self.normalizer)
            if cfg.kl.coef > 0:
                loss = loss + cfg.kl.coef * kl_term
            sums["kl_ref"] += float(kl_term.detach())
        if values is not None and mb.returns is not None and mb.values is not None:
            v_loss, v_sums = value_terms(values, mb, mask, cfg.value.clip, self.g_tokens)
            loss = loss + cfg.value.coef * v_loss
            for key, share in v_sums.items():
                sums[key] += share
        for name, teacher in mb.teachers.items():
            assert logits is not None, "distillation needs the whole logits (the engine computes them)"
            loss = self._distill(loss, name, teacher, lp, logits, mask)
        weight = float(mask.sum()) / tokens
        if routed is not None:
            loss = self._route(loss, routed, weight)
        (loss * self.ranks).backward()
        with torch.no_grad():
            k3 = kl(lp.detach(), behaviour, "k3")
            sums["kl_behaviour"] += float(torch.where(mask, k3, 0.0).sum()) / tokens
        sums["pg_loss"] += float(out.loss.detach())
        sums["entropy"] += float(ent_term.detach())
        for key in ("clip_fraction", "approx_kl", "is_weight_mean", "is_truncated_fraction"):
            sums[key] += out.metrics.get(key, 0.0) * weight
        self.ratio_max = max(self.ratio_max, out.metrics.get("ratio_max", 0.0))
        self.is_max = max(self.is_max, out.metrics.get("is_weight_max", 0.0))

    def _distill(
        self,
        loss: torch.Tensor,
        name: str,
        teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        lp: torch.Tensor,
        logits: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """`loss` plus the term of teacher `name` (the forward KL to its top-k, weighted, unless
        distill_coef is 0), adding its metrics: the KL, top-1 agreement and reverse KL of the samples."""
        distill, sums, tokens = self.settings.distill, self.sums, max(self.g_tokens, 1.0)
        top_ids, top_lp, sampled = teacher
        d_loss, per = topk_forward_kl(
            logits, top_ids.to(self.device), top_lp.to(self.device), mask, temperature=self.temperature,
            floor=distill.floor, aggregation=self.settings.loss.aggregation, normalizer=self.normalizer,
        )  # fmt: skip
        weight = distill.teachers[name]
        if distill.coef > 0:
            loss = loss + distill.coef * weight * d_loss
        with torch.no_grad():
            reverse = torch.where(mask, lp.detach() - sampled.to(self.device), 0.0).sum()
            sums["distill_loss"] += weight * float(d_loss.detach())
            sums[f"{name}_kl"] += float(per["kl"].sum()) / tokens
            sums[f"{name}_agreement"] += float(per["agree"].sum()) / tokens
            sums[f"{name}_reverse_kl"] += float(reverse) / tokens
        return loss

    def _route(self, loss: torch.Tensor, routed: Routed, weight: float) -> torch.Tensor:
        """`loss` plus the routers' auxiliary loss of the micro-batch (its share `weight` of the step's
        tokens, times moe.aux_loss_coef; none when that is 0), adding the tokens each expert received."""
        coef = self.settings.moe.aux_loss_coef
        aux = routed.aux_loss()
        if coef > 0:
            loss = loss + coef * weight * aux
        self.sums["moe/aux_loss"] += float(aux.detach()) * weight
        for key, n in zip(self.routing_keys, routed.counts().flatten().tolist(), strict=True):
            self.sums[key] += n
        return loss

    def finite(self, reduced: dict[str, float]) -> bool:
        """Whether the step's loss is finite, from `reduced` (`sums` summed over every rank)."""
        total = (reduced["pg_loss"] + reduced["kl_ref"] + reduced.get("distill_loss", 0.0)
                 + reduced.get("value_loss", 0.0) + reduced.get("moe/aux_loss", 0.0))  # fmt: skip
        return math.isfinite(total)

    def metrics(
        self, reduced: dict[str, float], reduce_max: Callable[[list[float]], float]
    ) -> dict[str, float]:
        """The step's metrics from `reduced` (`sums` summed over every rank), with the step's loss and
        the maxima over every rank (`reduce_max`: collective)."""
        cfg = self.settings
        if cfg.loss.off_policy == "none":
            for key in ("is_weight_mean", "is_truncated_fraction"):
                del reduced[key]
        else:
            reduced["is_weight_max"] = reduce_max([self.is_max])
        if self.experts is not None:
            counts = torch.tensor([reduced.pop(k) for k in self.routing_keys], dtype=torch.float64)
            reduced.update(load_metrics(counts.view(self.experts)))
        return {
            **reduced,
            "loss": reduced["pg_loss"]
            - cfg.loss.entropy_coef * reduced["entropy"]
            + cfg.kl.coef * reduced["kl_ref"]
            + (cfg.distill.coef * reduced["distill_loss"] if "distill_loss" in reduced else 0.0)
            + (cfg.value.coef * reduced["value_loss"] if "value_loss" in reduced else 0.0)
            + (cfg.moe.aux_loss_coef * reduced["moe/aux_loss"] if "moe/aux_loss" in reduced else 0.0),
            "ratio_max": reduce_max([self.ratio_max]),
        }


def policy_loss(
    lp: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    normalizer: float,
    g_rows: float,
) -> PolicyLoss:
    """The policy loss `cfg` names: GSPO, or by `cfg.off_policy` PPO clipping current / behaviour
    ("none"), decoupled PPO clipping current / proximal ("decoupled"), truncated IS ("tis")."""
    if cfg.policy == "gspo":
        old = behaviour if cfg.off_policy == "none" else proximal
        return gspo(lp, old, adv, mask, normalizer=g_rows)
    if cfg.off_policy == "decoupled":
        return decoupled_ppo(
            lp, proximal, behaviour, adv, mask, cap=cfg.is_cap, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, normalizer=normalizer,
        )  # fmt: skip
    if cfg.off_policy == "tis":
        return tis(
            lp, behaviour, adv, mask, cap=cfg.is_cap, aggregation=cfg.aggregation, normalizer=normalizer
        )
    return ppo_clip(
        lp, behaviour, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        aggregation=cfg.aggregation, normalizer=normalizer,
    )  # fmt: skip


def value_terms(
    values: torch.Tensor, mb: TrainBatch, mask: torch.Tensor, clip: float | None, g_tokens: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped value loss of a micro-batch that carries the values its advantages were computed with
    and the returns (normalised by the step's `g_tokens`), and its shares of the step's metrics."""
    assert mb.values is not None and mb.returns is not None
    tokens = max(g_tokens, 1.0)
    loss, metrics = value_loss(
        values, mb.values.to(mask.device), mb.returns.to(mask.device), mask, clip=clip, normalizer=tokens
    )
    weight = float(mask.sum()) / tokens
    return loss, {
        "value_loss": float(loss.detach()),
        "value_clip_fraction": metrics["value_clip_fraction"] * weight,
        "values_mean": float(torch.where(mask, values.detach(), 0.0).sum()) / tokens,
    }
