"""The training engine: an HF causal LM sharded with FSDP2, updated by a configurable policy loss.

One engine, many algorithms: `update_policy(batch, cfg)` runs the step the config describes (PPO clip or
GSPO, token or sequence aggregation, entropy bonus, KL to a reference), with gradient accumulation over
micro-batches and loss normalisation over the whole step across every data-parallel rank. It works on
CPU (gloo) and GPU (NCCL). With one rank the model is not wrapped at all (FSDP's hooks would be pure
overhead) and AdamW runs fused.

`get_weights()` yields full (unsharded) tensors in `manifest()` order; every rank must iterate it (the
gather is collective) and only rank 0 keeps what it yields.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from meshrl.algorithms.distill import topk_forward_kl
from meshrl.algorithms.losses import (
    aggregate,
    decoupled_ppo,
    entropy,
    gspo,
    kl,
    ppo_clip,
    tis,
    token_logprobs,
    value_loss,
)
from meshrl.dataplane.batch import DTYPE_NAMES
from meshrl.engines.optim import OptimConfig, lr_factor
from meshrl.engines.packing import TrainBatch

HEADS = ("lm", "value", "lm+value")
VALUE_HEAD_FILE = "value_head.safetensors"
"""The actor-critic's value head, saved next to the policy's HF checkpoint (which loads without it)."""


class FSDPEngine:
    """A policy being trained. Construct on every rank of the trainer's process group."""

    def __init__(
        self,
        model_path: str,
        optim: OptimConfig,
        *,
        device: torch.device,
        loader_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        head: str = "lm",
        temperature: float = 1.0,
    ) -> None:
        """head "lm": a policy (AutoModelForCausalLM); "value": a critic, the same backbone with a scalar
        head per token (AutoModelForTokenClassification, num_labels=1, the head freshly initialised when
        `model_path` is a causal LM); "lm+value": a shared-backbone actor-critic, the policy with a
        linear value head on its last hidden state (`model.value_head`, loaded from VALUE_HEAD_FILE in
        `model_path` when there is one, else zero: every value starts at 0). `temperature`: the policy's
        log-probabilities are taken under logits / temperature, the distribution inference samples."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, not {head!r}")
        torch.manual_seed(seed)
        self.head = head
        self.temperature = temperature
        self.device = device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if not os.path.exists(model_path):
            raise FileNotFoundError(f"trainer model path {model_path!r} does not exist")
        model: Any
        if head == "value":
            model = AutoModelForTokenClassification.from_pretrained(
                model_path, num_labels=1, **(loader_kwargs or {})
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, **(loader_kwargs or {}))
        model.config.use_cache = False
        self.hf_config = model.config
        # values need the last hidden state, not the logits: most HF models can skip all but one
        self._logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        if head == "lm+value":
            model.value_head = _value_head(model, model_path)
        model.to(device)
        if self.world > 1:  # one rank has nothing to shard: FSDP's hooks would be pure overhead
            mesh = init_device_mesh(device.type, (self.world,))
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            if head == "lm+value":  # called outside the model's forward: its own unit
                fully_shard(model.value_head, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model: Any = model
        self._manifest = [(n, tuple(p.shape), DTYPE_NAMES[p.dtype]) for n, p in self._policy_parameters()]
        # No dropout in RL (HF's classification heads default to 0.1): recomputed logprobs must match
        # inference's, and a critic's values must not depend on the random state. Gradients still flow.
        self.model.eval()
        self.optim_cfg = optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            eps=1e-8,
            **({"fused": True} if self.world == 1 else {"foreach": True}),
        )
        self.steps = 0
        self._set_lr()

    # ---------------------------------------------------------------------------------------------------

    def _set_lr(self) -> float:
        lr = self.optim_cfg.lr * lr_factor(self.steps, self.optim_cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def all_sum(self, values: list[float]) -> list[float]:
        """Sums over the trainer's ranks (on the engine's device, as NCCL needs)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def forward_logprobs(
        self, mb: TrainBatch, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs [n, L-1] of the next tokens, entropy [n, L-1], logits [n, L-1, V]); logprobs and
        entropy under logits / temperature."""
        lp, ent, logits, _ = self._policy_forward(mb, temperature)
        return lp, ent, logits

    def _policy_forward(
        self, mb: TrainBatch, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """forward_logprobs, plus the values [n, L-1] of the actor-critic's value head (else None) from
        the same forward."""
        ids = mb.input_ids.to(self.device)
        attn = mb.attention_mask.to(self.device)
        both = self.head == "lm+value"
        out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=both)
        logits = out.logits[:, :-1]
        lp = token_logprobs(logits, ids[:, 1:], temperature=temperature)
        ent = entropy(logits, temperature=temperature)
        values = self._head_values(out.hidden_states[-1]) if both else None
        return lp, ent, logits, values

    def _head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.value_head
        return head(hidden[:, :-1].to(_local(head.weight).dtype)).squeeze(-1).float()

    def update_policy(self, batch: TrainBatch, cfg: Any) -> dict[str, float]:
        """Train on `batch` (this rank's share of a mini-batch) as `cfg` (a TrainerConfig) describes:
        `cfg.epochs` optimizer steps over all of it, each accumulating gradients over micro-batches.

        The loss follows `cfg.off_policy`: "none" clips the ratio current / behaviour (the logprobs the
        sample was generated with); "decoupled" clips current / proximal, where the proximal policy is
        the weights at the start of this step (`snapshot`; for samples generated with exactly those, the
        behaviour logprobs), and weights each token by min(proximal / behaviour, cfg.is_cap); "tis" is
        truncated-importance-weighted REINFORCE against the behaviour policy. Returns metrics averaged over epochs (timings summed); an epoch
        with a non-finite loss or gradient is skipped and counted in `nan_skipped`.
        """
        order = torch.argsort(batch.attention_mask.sum(1), descending=True)
        chunks = list(order.split(cfg.micro_batch))
        proximal = (
            [self._proximal(batch.rows(c), cfg) for c in chunks] if cfg.off_policy == "decoupled" else []
        )
        results = [self._epoch(batch, chunks, proximal, cfg) for _ in range(cfg.epochs)]
        out = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
        for key in ("nan_skipped", "time/forward_backward_s", "time/optimizer_s"):
            out[key] = sum(r[key] for r in results)
        out["ratio_max"] = max(r["ratio_max"] for r in results)
        return out

    def _epoch(
        self, batch: TrainBatch, chunks: list[torch.Tensor], proximal: list[torch.Tensor], cfg: Any
    ) -> dict[str, float]:
        """One optimizer step on `batch`, accumulating gradients over micro-batches."""
        t0 = time.perf_counter()
        tokens, rows = float(batch.mask.sum()), float((batch.mask.sum(1) > 0).sum())
        g_tokens, g_rows, g_n = self.all_sum([tokens, rows, float(len(batch))])
        normalizer = g_tokens if cfg.loss_agg == "token-mean" else g_n
        # every rank must run the same number of micro-batches (FSDP collectives); pad with empty ones
        n_chunks = int(self._max([len(chunks)]))
        keys = ("pg_loss", "entropy", "kl_ref", "kl_behaviour", "clip_fraction", "approx_kl")
        sums = dict.fromkeys(keys, 0.0)
        sums.update(is_weight_mean=0.0, is_truncated_fraction=0.0)
        if self.head == "lm+value" and batch.returns is not None:
            sums.update(value_loss=0.0, value_clip_fraction=0.0, values_mean=0.0)
        if batch.teachers:  # forward KL to each teacher's top-k, top-1 agreement, reverse KL
            sums["distill_loss"] = 0.0
            for name in sorted(batch.teachers):
                sums.update({f"{name}_kl": 0.0, f"{name}_agreement": 0.0, f"{name}_reverse_kl": 0.0})
        ratio_max = is_max = 0.0
        for k in range(n_chunks):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(k == n_chunks - 1)
            mb = batch.rows(chunks[k] if k < len(chunks) else chunks[0][:1])
            if k >= len(chunks):
                mb.mask = torch.zeros_like(mb.mask)
            mask = mb.mask.to(self.device)
            lp, ent, logits, values = self._policy_forward(mb, self.temperature)
            behaviour = mb.old_logprobs.to(self.device)
            prox = proximal[k] if k < len(proximal) else behaviour
            out = self._policy_loss(
                lp, prox, behaviour, mb.advantages.to(self.device), mask, cfg, normalizer, g_rows
            )
            ent_term = aggregate(ent, mask, cfg.loss_agg, normalizer)
            loss = out.loss - cfg.entropy_coef * ent_term
            if mb.ref_logprobs is not None:
                kl_ref = kl(lp, mb.ref_logprobs.to(self.device), cfg.kl_estimator)
                kl_term = aggregate(kl_ref, mask, cfg.loss_agg, normalizer)
                if cfg.kl_coef > 0:
                    loss = loss + cfg.kl_coef * kl_term
                sums["kl_ref"] += float(kl_term.detach())
            if values is not None and mb.returns is not None and mb.values is not None:
                v_loss, v_metrics = value_loss(
                    values, mb.values.to(self.device), mb.returns.to(self.device), mask, clip=cfg.value_clip,
                    normalizer=max(g_tokens, 1.0),
                )  # fmt: skip
                loss = loss + cfg.value_coef * v_loss
                weight = float(mask.sum()) / max(g_tokens, 1.0)
                sums["value_loss"] += float(v_loss.detach())
                sums["value_clip_fraction"] += v_metrics["value_clip_fraction"] * weight
                sums["values_mean"] += float(torch.where(mask, values.detach(), 0.0).sum()) / max(
                    g_tokens, 1.0
                )
            for name, (top_ids, top_lp, sampled) in mb.teachers.items():
                d_loss, per = topk_forward_kl(
                    logits, top_ids.to(self.device), top_lp.to(self.device), mask, temperature=self.temperature,
                    floor=cfg.distill_floor, aggregation=cfg.loss_agg, normalizer=normalizer,
                )  # fmt: skip
                if cfg.distill_coef > 0:
                    loss = loss + cfg.distill_coef * cfg.teachers[name] * d_loss
                with torch.no_grad():
                    reverse = torch.where(mask, lp.detach() - sampled.to(self.device), 0.0).sum()
                    sums["distill_loss"] += cfg.teachers[name] * float(d_loss.detach())
                    sums[f"{name}_kl"] += float(per["kl"].sum()) / max(g_tokens, 1.0)
                    sums[f"{name}_agreement"] += float(per["agree"].sum()) / max(g_tokens, 1.0)
                    sums[f"{name}_reverse_kl"] += float(reverse) / max(g_tokens, 1.0)
            loss.backward()
            weight = float(mask.sum()) / max(g_tokens, 1.0)
            with torch.no_grad():
                k3 = kl(lp.detach(), behaviour, "k3")
                sums["kl_behaviour"] += float(torch.where(mask, k3, 0.0).sum()) / max(g_tokens, 1.0)
            sums["pg_loss"] += float(out.loss.detach())
            sums["entropy"] += float(ent_term.detach())
            for key in ("clip_fraction", "approx_kl", "is_weight_mean", "is_truncated_fraction"):
                sums[key] += out.metrics.get(key, 0.0) * weight
            ratio_max = max(ratio_max, out.metrics.get("ratio_max", 0.0))
            is_max = max(is_max, out.metrics.get("is_weight_max", 0.0))
        t1 = time.perf_counter()
        reduced = dict(zip(sums, self.all_sum(list(sums.values())), strict=True))
        total = (reduced["pg_loss"] + reduced["kl_ref"] + reduced.get("distill_loss", 0.0)
                 + reduced.get("value_loss", 0.0))  # fmt: skip
        step = self._step(loss_finite=math.isfinite(total))
        t2 = time.perf_counter()
        if cfg.off_policy == "none":
            for key in ("is_weight_mean", "is_truncated_fraction"):
                del reduced[key]
        else:
            reduced["is_weight_max"] = self._max([is_max])
        return {
            **reduced,
            "loss": reduced["pg_loss"]
            - cfg.entropy_coef * reduced["entropy"]
            + cfg.kl_coef * reduced["kl_ref"]
            + (cfg.distill_coef * reduced["distill_loss"] if "distill_loss" in reduced else 0.0)
            + (cfg.value_coef * reduced["value_loss"] if "value_loss" in reduced else 0.0),
            "ratio_max": self._max([ratio_max]),
            **step,
            "time/forward_backward_s": t1 - t0,
            "time/optimizer_s": t2 - t1,
        }

    # ---------------------------------------------------------------------------------------------------
    # the value head (critic)

    def forward_values(self, mb: TrainBatch) -> torch.Tensor:
        """Values [n, L-1]: position t is the value of the state that predicts token t+1."""
        ids = mb.input_ids.to(self.device)
        attn = mb.attention_mask.to(self.device)
        if self.head == "lm+value":  # the last hidden state; of the logits only one position
            few = {"logits_to_keep": 1} if self._logits_to_keep else {}
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True, **few)
            return self._head_values(out.hidden_states[-1])
        return self.model(input_ids=ids, attention_mask=attn).logits[:, :-1, 0].float()

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, micro_batch: int) -> torch.Tensor:
        """Values of every position of `batch` (no gradient), computed `micro_batch` rows at a time.
        Collective under FSDP: every rank runs as many forwards as the rank with the most rows."""
        out = torch.zeros(batch.mask.shape, dtype=torch.float32)
        chunks = list(torch.arange(len(batch)).split(micro_batch))
        for k in range(int(self._max([len(chunks)]))):
            if k >= len(chunks):  # keep step with the other ranks' collectives; nothing to keep
                self.forward_values(batch.rows(torch.tensor([0])))
                continue
            mb = batch.rows(chunks[k])
            out[chunks[k], : mb.mask.shape[1]] = self.forward_values(mb).cpu()
        return out

    def update_value(self, batch: TrainBatch, cfg: Any) -> dict[str, float]:
        """`cfg.epochs` optimizer steps of the clipped value loss (cfg.value_clip) on `batch`, which
        carries the values its advantages were computed with and the returns."""
        assert batch.values is not None and batch.returns is not None, "update_value needs values, returns"
        order = torch.argsort(batch.attention_mask.sum(1), descending=True)
        chunks = list(order.split(cfg.micro_batch))
        results = []
        for _ in range(cfg.epochs):
            t0 = time.perf_counter()
            (g_tokens,) = self.all_sum([float(batch.mask.sum())])
            n_chunks = int(self._max([len(chunks)]))
            sums = {"value_loss": 0.0, "value_clip_fraction": 0.0, "values_mean": 0.0}
            for k in range(n_chunks):
                if hasattr(self.model, "set_requires_gradient_sync"):
                    self.model.set_requires_gradient_sync(k == n_chunks - 1)
                mb = batch.rows(chunks[k] if k < len(chunks) else chunks[0][:1])
                mask = mb.mask.to(self.device) & (k < len(chunks))
                v = self.forward_values(mb)
                assert mb.values is not None and mb.returns is not None
                loss, metrics = value_loss(
                    v, mb.values.to(self.device), mb.returns.to(self.device), mask, clip=cfg.value_clip,
                    normalizer=max(g_tokens, 1.0),
                )  # fmt: skip
                loss.backward()
                weight = float(mask.sum()) / max(g_tokens, 1.0)
                sums["value_loss"] += float(loss.detach())
                sums["value_clip_fraction"] += metrics["value_clip_fraction"] * weight
                sums["values_mean"] += float(torch.where(mask, v.detach(), 0.0).sum()) / max(g_tokens, 1.0)
            reduced = dict(zip(sums, self.all_sum(list(sums.values())), strict=True))
            t1 = time.perf_counter()
            step = self._step(loss_finite=math.isfinite(reduced["value_loss"]))
            results.append({**reduced, **step, "time/forward_backward_s": t1 - t0})
            results[-1]["time/optimizer_s"] = time.perf_counter() - t1
        out = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
        for key in ("nan_skipped", "time/forward_backward_s", "time/optimizer_s"):
            out[key] = sum(r[key] for r in results)
        return out

    def _step(self, *, loss_finite: bool) -> dict[str, float]:
        """Clip gradients and take an optimizer step unless the loss or gradients are not finite."""
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        finite = math.isfinite(grad_norm) and loss_finite
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
            self.steps += 1
            self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "nan_skipped": 0.0 if finite else 1.0}

    # ---------------------------------------------------------------------------------------------------

    def offload(self, path: str) -> int:
        """Parameters and optimizer state out of memory into the file `path` (gradients are None between
        steps). Returns bytes released."""
        from meshrl.runtime.offload import HostStore

        self.store = HostStore(path)
        named = [(f"param:{n}", _local(p)) for n, p in self.model.named_parameters()]
        for i, state in enumerate(self.optimizer.state.values()):
            named += [(f"optim:{i}:{k}", _local(v)) for k, v in state.items() if isinstance(v, torch.Tensor)]
        return self.store.offload(named)

    def restore(self) -> int:
        return self.store.restore()

    def snapshot(self) -> None:
        """Remember the current weights as the proximal policy (called at the start of each step)."""
        with torch.no_grad():
            self._snapshot = [_local(p).clone() for p in self.model.parameters()]

    def _proximal(self, mb: TrainBatch, cfg: Any) -> torch.Tensor:
        """Logprobs of the proximal policy (the weights at the start of this step) for a micro-batch.

        Samples generated with those very weights need no recomputation: their behaviour logprobs are
        the proximal ones. Stale samples are scored with the snapshot swapped in for one forward.
        """
        behaviour = mb.old_logprobs.to(self.device)
        if mb.stale is None or not bool(mb.stale.any()) or not hasattr(self, "_snapshot"):
            return behaviour
        params = list(self.model.parameters())
        with torch.no_grad():
            current = [_local(p).clone() for p in params]
            for p, old in zip(params, self._snapshot, strict=True):
                _local(p).copy_(old)
            try:
                lp, _, _ = self.forward_logprobs(mb, self.temperature)
            finally:
                for p, now in zip(params, current, strict=True):
                    _local(p).copy_(now)
        stale = mb.stale.to(self.device).unsqueeze(-1)
        return torch.where(stale, lp.detach(), behaviour)

    @staticmethod
    def _policy_loss(
        lp: torch.Tensor,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        cfg: Any,
        normalizer: float,
        g_rows: float,
    ) -> Any:
        if cfg.policy_loss == "gspo":
            old = behaviour if cfg.off_policy == "none" else proximal
            return gspo(lp, old, adv, mask, normalizer=g_rows)
        if cfg.off_policy == "decoupled":
            return decoupled_ppo(
                lp, proximal, behaviour, adv, mask, cap=cfg.is_cap, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip, aggregation=cfg.loss_agg, normalizer=normalizer,
            )  # fmt: skip
        if cfg.off_policy == "tis":
            return tis(
                lp, behaviour, adv, mask, cap=cfg.is_cap, aggregation=cfg.loss_agg, normalizer=normalizer
            )
        return ppo_clip(
            lp, behaviour, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
            aggregation=cfg.loss_agg, normalizer=normalizer,
        )  # fmt: skip

    def _max(self, values: list[float]) -> float:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.max())

    # ---------------------------------------------------------------------------------------------------
    # weights and checkpoints

    def _policy_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters inference generates with (the actor-critic's value head is not one)."""
        return [(n, p) for n, p in self.model.named_parameters() if not n.startswith("value_head.")]

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each weight `get_weights` yields, in order (walked once, in __init__)."""
        return list(self._manifest)

    def get_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Full tensors in manifest order (collective: every rank iterates it).

        Shards are gathered one bucket of parameters at a time with a single all-gather each, so the
        cost is a few collectives per model rather than one per parameter, and memory stays bounded.
        """
        params = [p for _, p in self._policy_parameters()]
        with torch.no_grad():
            if self.world == 1:
                for p in params:
                    yield (p.to_local() if hasattr(p, "to_local") else p).detach()
                return
            bucket: list[torch.Tensor] = []
            size = 0
            for p in params:
                if bucket and (
                    size + p.numel() * p.element_size() > bucket_bytes or p.dtype != bucket[0].dtype
                ):
                    yield from self._gather(bucket)
                    bucket, size = [], 0
                bucket.append(p)
                size += p.numel() * p.element_size()
            if bucket:
                yield from self._gather(bucket)

    def _gather(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full tensors of dim-0-sharded parameters (torch.chunk layout) with one all-gather."""
        world = self.world
        pieces, layout = [], []
        for p in params:
            local = p.to_local()  # type: ignore[attr-defined]
            chunk = -(-p.shape[0] // world)
            padded = torch.zeros((chunk, *p.shape[1:]), dtype=p.dtype, device=local.device)
            padded[: local.shape[0]] = local
            pieces.append(padded.reshape(-1))
            layout.append((p.shape, chunk))
        flat = torch.cat(pieces)
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(out, flat)
        grid = out.view(world, -1)
        full, offset = [], 0
        for shape, chunk in layout:
            n = chunk * math.prod(shape[1:])
            full.append(grid[:, offset : offset + n].reshape(world * chunk, *shape[1:])[: shape[0]])
            offset += n
        return full

    def save_pretrained(self, path: str, tokenizer_from: str | None = None) -> None:
        """A Hugging Face checkpoint that from_pretrained loads (collective; rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if dist.is_initialized():
            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if self.rank == 0:
            from safetensors.torch import save_file
            from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

            head: dict[str, Any] = {
                k.removeprefix("value_head."): state.pop(k)
                for k in list(state)
                if k.startswith("value_head.")
            }
            auto = AutoModelForTokenClassification if self.head == "value" else AutoModelForCausalLM
            with torch.device("meta"):
                shell = auto.from_config(self.hf_config)
            shell.load_state_dict(state, assign=True)
            shell.tie_weights()
            shell.config.use_cache = True
            shell.save_pretrained(path)
            if head:
                save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(path, VALUE_HEAD_FILE))
            if tokenizer_from is not None:
                AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer and step count, sharded as trained (torch.distributed.checkpoint; collective).

        Every rank writes its own shards into the directory `path`; `load_checkpoint` reads them back on
        any number of ranks (resharding as needed)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        with _single_process_ok():
            dcp.save({"model": model, "optim": optim, "steps": torch.tensor(self.steps)}, checkpoint_id=path)

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        steps = torch.tensor(0)
        with _single_process_ok():
            dcp.load({"model": model, "optim": optim, "steps": steps}, checkpoint_id=path)  # in place
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim)
        self.steps = int(steps)
        self._set_lr()

    def continue_schedule(self, steps: int) -> None:
        """Go on with the learning-rate schedule at optimizer step `steps` (weights loaded from an older
        checkpoint by a service that re-joins a run past it)."""
        self.steps = steps
        self._set_lr()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """torch.distributed.checkpoint warns when there is no process group; one rank needs none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (each becomes one FSDP unit)."""
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def _value_head(model: Any, model_path: str) -> torch.nn.Linear:
    """A linear value head on `model`'s last hidden state, in the model's dtype: saved weights when
    `model_path` has them, else zero."""
    hidden = model.config.get_text_config().hidden_size
    dtype = next(model.parameters()).dtype
    head = torch.nn.Linear(hidden, 1, dtype=dtype)
    saved = os.path.join(model_path, VALUE_HEAD_FILE)
    if os.path.exists(saved):
        from safetensors.torch import load_file

        head.load_state_dict(load_file(saved))
    else:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return head


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (its shard under FSDP)."""
    return p.to_local() if hasattr(p, "to_local") else p
