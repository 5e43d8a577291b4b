"""The training engine: an HF causal LM sharded with FSDP2, updated by a configurable policy loss.

One engine, many algorithms: `update_policy(batch, loss, kl=..., distill=..., value=...)` runs the step
those sections describe (meshrl/engines/settings.py: PPO clip or GSPO, token or sequence aggregation,
entropy bonus, KL to a reference, distillation, a value head), with gradient accumulation over
micro-batches and loss normalisation over the whole step across every data-parallel rank. It works on
CPU (gloo) and GPU (NCCL). With one rank the model is not wrapped at all (FSDP's hooks would be pure
overhead) and AdamW runs fused. The same engine with `head="value"` is the critic (`value.ValueEngine`).

Here: the optimizer, the forwards, the micro-batch loop of each optimizer step and the step itself.
Beside it: how the model is built (loading, value head, checkpointing, LoRA, FSDP: `building.py`), what
a step minimises and reports (`objective.py`), the full tensors gathered for publication (`gather.py`),
and the model on disk (`checkpoints.py`, `lora.py`).

`get_weights()` yields full (unsharded) tensors in `manifest()` order; every rank must iterate it (the
gather is collective) and only rank 0 keeps what it yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from meshrl.algorithms.chunked import head_logprobs
from meshrl.algorithms.losses import entropy, token_logprobs
from meshrl.dataplane.batch import DTYPE_NAMES
from meshrl.engines import checkpoints
from meshrl.engines.building import build
from meshrl.engines.experts import attach, recording
from meshrl.engines.gather import full_tensors
from meshrl.engines.lora import adapter_parameters, merged_parameters, save_adapter, train_dropout
from meshrl.engines.objective import Objective, PolicyObjective
from meshrl.engines.optim import lr_factor
from meshrl.engines.packing import TrainBatch, token_micro_batches
from meshrl.engines.settings import (
    DistillConfig,
    KLLossConfig,
    LoraConfig,
    LossConfig,
    MemoryConfig,
    MoEConfig,
    OptimConfig,
    ValueHeadConfig,
)
from meshrl.engines.shared_prompts import grouped, indexable, plan, prompt_shared_hidden
from meshrl.models.vision import model_inputs
from meshrl.observe.metrics import merged

HEADS = ("lm", "value", "lm+value")


class FSDPEngine:
    """A policy being trained. Construct on every rank of the trainer's process group."""

    def __init__(
        self,
        model_path: str,
        optim: OptimConfig,
        *,
        device: torch.device,
        memory: MemoryConfig = MemoryConfig(),
        lora: LoraConfig | None = None,
        total_steps: int = 1,
        loader_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        head: str = "lm",
        temperature: float = 1.0,
        publish_adapters: bool = False,
        train_vision: bool = False,
    ) -> None:
        """head "lm": a policy (AutoModelForCausalLM); "value": a critic, the same backbone with a scalar
        head per token (AutoModelForTokenClassification, num_labels=1, the head freshly initialised when
        `model_path` is a causal LM); "lm+value": a shared-backbone actor-critic, the policy with a
        linear value head on its last hidden state (`model.value_head`, loaded from
        `checkpoints.VALUE_HEAD_FILE` in `model_path` when there is one, else zero: every value starts
        at 0). `temperature`: the policy's log-probabilities are taken under logits / temperature, the
        distribution inference samples. `total_steps`: optimizer steps the learning-rate schedule spans.
        The sections `optim`, `memory` and `lora` are meshrl/engines/settings.py's; under bf16-mixed the
        model is loaded and kept in float32 (master weights) and published in bfloat16, and with
        `publish_adapters` a LoRA policy publishes its adapters alone. A vision-language model's vision
        tower stays frozen unless `train_vision`."""
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, not {head!r}")
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.publish_adapters = publish_adapters and self.lora is not None
        torch.manual_seed(seed)
        self.head = head
        self.temperature = temperature
        self.device = device
        self.compute_dtype = torch.bfloat16 if memory.precision == "bf16-mixed" else torch.float32
        self.memory, self.total_steps = memory, total_steps
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        built = build(
            model_path,
            head,
            loader_kwargs,
            memory,
            self.lora,
            self.compute_dtype,
            device,
            self.world,
            train_vision,
        )
        model, self.hf_config = built.model, built.model_config
        # values need the last hidden state, not the logits: most HF models can skip all but one
        self._logits_to_keep = built.logits_to_keep
        # chunked log-probs need logits that are the output projection of the last hidden state
        self._chunked = (
            memory.logits_chunk > 0 and head != "value" and built.logits_to_keep and built.linear_head
        )
        self.model: Any = model
        self.routing = attach(model)  # a mixture of experts' routers, hooked (None: a dense model)
        self._share = head == "lm" and not (self.routing or memory.activation_checkpointing)  # a group's
        self._share = self._share and indexable(self.hf_config)  # rows run their prompt once
        self._manifest = [
            (n, tuple(p.shape), DTYPE_NAMES[self._published(p.dtype)]) for n, p in self._policy_parameters()
        ]
        # No dropout in RL (HF's classification heads default to 0.1): recomputed logprobs must match
        # inference's, and a critic's values must not depend on the random state. Gradients still flow.
        self.model.eval()
        if self.lora is not None:
            train_dropout(self.model)
        self.optim_cfg = optim
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],  # LoRA: the adapters
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
        lr = self.optim_cfg.lr * lr_factor(self.steps, self.optim_cfg, self.total_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def all_sum(self, values: list[float]) -> list[float]:
        """Sums over the trainer's ranks (on the engine's device, as NCCL needs)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _inputs(self, mb: TrainBatch) -> dict[str, torch.Tensor | None]:
        """The model's inputs for `mb`: with position ids (samples packed into rows, `packing.py`) no
        attention mask, so that transformers derives a block-diagonal one from the restarting positions;
        a vision-language model's images (`vision.model_inputs`)."""
        pixels = {} if mb.images is None else model_inputs(mb.images, self.device)
        if mb.position_ids is not None:
            return {"position_ids": mb.position_ids.to(self.device), "attention_mask": None, **pixels}
        return {"attention_mask": mb.attention_mask.to(self.device), **pixels}

    def forward_logprobs(self, mb: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [n, L-1] of the next tokens, entropy [n, L-1]) under logits / temperature, at the
        positions of `mb.mask` (0 elsewhere, unless the whole logits are computed)."""
        lp, ent, _, _ = self._policy_forward(mb, temperature)
        return lp, ent

    def _policy_forward(
        self, mb: TrainBatch, temperature: float, *, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """forward_logprobs, plus the logits [n, L-1, V] when they were computed whole (else None:
        computed whole for distillation, with logits_chunk 0, and for logits that are not a plain
        projection of the last hidden state) and the values [n, L-1] of the actor-critic's value head
        (else None), from one forward. `entropy_grad`: whether the loss differentiates the entropy
        (whole logits only: the chunked head costs nothing for an unused one)."""
        ids = mb.input_ids.to(self.device)
        whole = bool(mb.teachers) or not self._chunked
        few = {} if whole else {"logits_to_keep": 1}  # the last hidden state is all the chunks need
        mask = mb.mask.to(self.device)
        prompts, values = plan(mb) if self._share and not whole else None, None
        with self._autocast():
            if prompts is not None:
                picked = prompt_shared_hidden(self.model, mb, prompts, self.device)
            else:
                out = self.model(input_ids=ids, **self._inputs(mb), output_hidden_states=True, **few)
                hidden = out.hidden_states[-1][:, :-1]
                values = self._head_values(hidden) if self.head == "lm+value" else None
                picked = hidden if whole else hidden[mask]  # the whole path reads the logits
        if whole:
            logits = out.logits[:, :-1]
            lp = token_logprobs(logits, ids[:, 1:], temperature=temperature)
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy(logits, temperature=temperature)
            return lp, ent, logits, values
        head = self.model.get_output_embeddings()
        bias = None if head.bias is None else head.bias.to(self.compute_dtype)
        lp, ent = head_logprobs(
            picked.to(self.compute_dtype), head.weight.to(self.compute_dtype), ids[:, 1:][mask],
            bias=bias, temperature=temperature, chunk=self.memory.logits_chunk,
        )  # fmt: skip
        return _scatter(mask, lp), _scatter(mask, ent), None, values

    def _head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.value_head
        return head(hidden.to(_local(head.weight).dtype)).squeeze(-1).float()

    def update_policy(
        self,
        batch: TrainBatch,
        loss: LossConfig = LossConfig(),
        *,
        kl: KLLossConfig = KLLossConfig(),
        distill: DistillConfig = DistillConfig(),
        value: ValueHeadConfig = ValueHeadConfig(),
        moe: MoEConfig = MoEConfig(),
        epochs: int = 1,
    ) -> dict[str, float]:
        """Train on `batch` (this rank's share of a mini-batch): `epochs` optimizer steps over all of it,
        each accumulating gradients over micro-batches, minimising what the sections describe
        (`objective.PolicyObjective`).

        The loss follows `loss.off_policy`: "none" clips the ratio current / behaviour (the logprobs the
        sample was generated with); "decoupled" clips current / proximal, where the proximal policy is
        the weights at the start of this step (`snapshot`; for samples generated with exactly those, the
        behaviour logprobs), and weights each token by min(proximal / behaviour, loss.is_cap); "tis" is
        truncated-importance-weighted REINFORCE against the behaviour policy (`objective.policy_loss`).
        Returns metrics averaged over epochs (timings summed); an epoch with a non-finite loss or
        gradient is skipped and counted in `nan_skipped`. A mixture of experts also reports its expert
        load, and adds its routers' auxiliary loss with `moe.aux_loss_coef` (`experts.py`).
        """
        micro = self._micro_batches(batch)
        proximal = [self._proximal(mb) for mb in micro] if loss.off_policy == "decoupled" else []
        objective = Objective(loss, kl, distill, value, moe)
        return merged([self._epoch(batch, micro, proximal, objective) for _ in range(epochs)])

    def _epoch(
        self, batch: TrainBatch, micro: list[TrainBatch], proximal: list[torch.Tensor], settings: Objective
    ) -> dict[str, float]:
        """One optimizer step on `batch`, accumulating gradients over micro-batches (`PolicyObjective`)."""
        t0 = time.perf_counter()
        tokens, rows = float(batch.mask.sum()), float((batch.mask.sum(1) > 0).sum())
        g_tokens, g_rows, g_n = self.all_sum([tokens, rows, float(len(batch))])
        both = self.head == "lm+value"
        objective = PolicyObjective(
            batch, settings, self.device, value_head=both, temperature=self.temperature, g_tokens=g_tokens,
            g_rows=g_rows, g_n=g_n, ranks=self.world,
            experts=None if self.routing is None else (self.routing.layers, self.routing.experts),
        )  # fmt: skip
        # every rank must run the same number of micro-batches (FSDP collectives); pad with empty ones
        n_chunks = int(self._max([len(micro)]))
        for k in range(n_chunks):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(k == n_chunks - 1)
            mb = micro[k] if k < len(micro) else dataclasses.replace(micro[0], mask=micro[0].mask & False)
            mask = mb.mask.to(self.device)
            counted = mb.attention_mask.bool() & (k < len(micro))  # a padding micro-batch counts none
            with recording(self.routing, counted, grad=settings.moe.aux_loss_coef > 0) as routed:
                forward = self._policy_forward(
                    mb, self.temperature, entropy_grad=settings.loss.entropy_coef > 0
                )
            behaviour = mb.old_logprobs.to(self.device)
            prox = proximal[k] if k < len(proximal) else behaviour
            objective.backward(mb, forward, prox, behaviour, mask, routed)
        t1 = time.perf_counter()
        reduced = dict(zip(objective.sums, self.all_sum(list(objective.sums.values())), strict=True))
        step = self._step(loss_finite=objective.finite(reduced), empty=g_tokens == 0)
        t2 = time.perf_counter()
        return {
            **objective.metrics(reduced, self._max),
            **step,
            "time/forward_backward_s": t1 - t0,
            "time/optimizer_s": t2 - t1,
        }

    # ---------------------------------------------------------------------------------------------------
    # the value head (critic)

    def forward_values(self, mb: TrainBatch) -> torch.Tensor:
        """Values [n, L-1]: position t is the value of the state that predicts token t+1."""
        ids = mb.input_ids.to(self.device)
        with self._autocast():
            if hasattr(self.model, "value_head"):  # the last hidden state; of the logits only one position
                few = {"logits_to_keep": 1} if self._logits_to_keep else {}
                out = self.model(input_ids=ids, **self._inputs(mb), output_hidden_states=True, **few)
                return self._head_values(out.hidden_states[-1][:, :-1])
            return self.model(input_ids=ids, **self._inputs(mb)).logits[:, :-1, 0].float()

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

    def _step(self, *, loss_finite: bool, empty: bool = False) -> dict[str, float]:
        """Clip gradients and take an optimizer step unless the loss or gradients are not finite, or the
        step had no tokens to learn from (`empty`: its gradient is zero, and Adam's momentum alone would
        still move the weights)."""
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        finite = math.isfinite(grad_norm) and loss_finite
        lr = self.optimizer.param_groups[0]["lr"]
        if finite and not empty:
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

    def _proximal(self, mb: TrainBatch) -> torch.Tensor:
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
                lp, _ = self.forward_logprobs(mb, self.temperature)
            finally:
                for p, now in zip(params, current, strict=True):
                    _local(p).copy_(now)
        stale = mb.stale.to(self.device)  # per row, or per token once packed
        return torch.where(stale if stale.dim() == 2 else stale[:, None], lp.detach(), behaviour)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """`memory.micro_batch` rows at a time, longest first (similar lengths pad little), or with
        `memory.max_tokens_per_micro_batch` samples packed into rows by tokens (`packing.token_micro_batches`)."""
        if self.memory.max_tokens_per_micro_batch:
            return token_micro_batches(batch, self.memory.max_tokens_per_micro_batch)
        order = torch.argsort(batch.attention_mask.sum(1), descending=True)
        order = grouped(batch, order) if self._share else order  # a group's rows in one micro-batch
        return [batch.rows(c) for c in order.split(self.memory.micro_batch)]

    def _max(self, values: list[float]) -> float:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.max())

    # ---------------------------------------------------------------------------------------------------
    # weights and checkpoints

    def _policy_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters inference generates with (the actor-critic's value head is not one; with LoRA,
        the base's with the adapters merged in, or the adapters alone for an engine that applies them)."""
        if self.publish_adapters:
            return adapter_parameters(self.model)
        if self.lora is not None:
            return merged_parameters(self.model)
        return [(n, p) for n, p in self.model.named_parameters() if not n.startswith("value_head.")]

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each weight `get_weights` yields, in order (walked once, in __init__)."""
        return list(self._manifest)

    def get_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Full tensors in manifest order (collective: every rank iterates it), gathered a bucket of
        parameters at a time (`gather.full_tensors`)."""
        for t in full_tensors([p for _, p in self._policy_parameters()], self.world, bucket_bytes):
            yield t.to(self._published(t.dtype))

    def _published(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype inference receives a parameter of `dtype` in: the compute dtype's, under mixed precision."""
        return self.compute_dtype if dtype == torch.float32 else dtype

    def save_pretrained(self, path: str, source: str | None = None) -> None:
        """A Hugging Face checkpoint that from_pretrained loads (collective; rank 0 writes), with what it
        keeps of `source`, the model it was trained from (`checkpoints.carry_over`). With LoRA: the
        adapter (PEFT's files, which name `source` as their base), and the merged model in `path`/merged
        when `lora.save_merged`."""
        if self.lora is not None:
            save_adapter(self.model, self.lora, self.hf_config, path, source=source, world=self.world)
            return
        critic = self.head == "value"
        checkpoints.save_pretrained(
            self.model, self.hf_config, path, critic=critic, rank=self.rank, source=source
        )

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer and step count, sharded as trained (torch.distributed.checkpoint; collective).

        Every rank writes its own shards into the directory `path`; `load_checkpoint` reads them back on
        any number of ranks (resharding as needed)."""
        checkpoints.save_sharded(self.model, self.optimizer, self.steps, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (collective)."""
        self.steps = checkpoints.load_sharded(self.model, self.optimizer, path)
        self._set_lr()

    def continue_schedule(self, steps: int) -> None:
        """Go on with the learning-rate schedule at optimizer step `steps` (weights loaded from an older
        checkpoint by a service that re-joins a run past it)."""
        self.steps = steps
        self._set_lr()


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[n, L-1] with `values` at the positions of `mask`, 0 elsewhere (differentiable)."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (its shard under FSDP)."""
    return p.to_local() if hasattr(p, "to_local") else p
