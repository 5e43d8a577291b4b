"""Per-token log-probabilities, entropy, KL estimators and the clipped policy-gradient losses.

The trainer's loss step is a composition of these pure functions, so that each piece (the clipping
rule, the aggregation over tokens, the KL estimator) is a named choice that can be tested on its own.
All [B, T] inputs are padded batches with a bool `mask`, True on the response tokens that count; values
at masked positions never reach the loss or its gradient, whatever they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "k2", "k3")


def aggregate(values: Tensor, mask: Tensor, mode: str, normalizer: float | None = None) -> Tensor:
    """Reduce per-token values [B, T] with mask [B, T] to a scalar.

    "token-mean": sum of masked values / (normalizer or number of masked tokens); every token weighs
    the same (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").
    "seq-mean-token-mean": mean over each row's tokens (0 for a row without tokens), summed over rows /
    (normalizer or B); the original GRPO form (Shao et al. 2024, DeepSeekMath).
    "seq-mean-token-sum": sum over each row's tokens, summed over rows / (normalizer or B); with a
    constant normalizer this is the length-unbiased form of Dr. GRPO (Liu et al. 2025).

    `normalizer` lets gradient accumulation over micro-batches and data-parallel ranks divide by the
    global token or row count, so that the summed micro-batch losses equal the full-batch loss.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; allowed: {', '.join(AGGREGATIONS)}")
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    m = mask.bool()
    v = torch.where(m, values, 0.0)  # where, not multiply: inf * 0 is nan
    if mode == "token-mean":
        denom = normalizer if normalizer is not None else m.sum().clamp_min(1).to(v.dtype)
        return v.sum() / denom
    per_row = v.sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / m.sum(-1).clamp_min(1).to(v.dtype)
    return per_row.sum() / (normalizer if normalizer is not None else max(values.shape[0], 1))


def _chunks(length: int, chunk: int | None) -> list[tuple[int, int]]:
    if chunk is None:
        return [(0, length)]
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    return x / temperature if temperature > 0 and temperature != 1.0 else x


def token_logprobs(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, chunk: int | None = None
) -> Tensor:
    """Log-probability of each target token: log_softmax(logits.float() / temperature)[targets].

    The per-token log pi(y_t | y_<t) of policy-gradient methods (Williams 1992, "Simple Statistical
    Gradient-Following Algorithms for Connectionist Reinforcement Learning"); the temperature must be the
    sampler's so that the trained policy is the one that generated the data.

    logits [B, T, V] (any float dtype), targets [B, T] int64 -> [B, T] float32. temperature <= 0 means 1.
    With `chunk`, at most `chunk` positions along T are converted to float32 at a time, which bounds the
    extra memory of the forward pass to [B, chunk, V] (under autograd each chunk still keeps its own
    saved tensors). The result equals the unchunked one.
    """
    if logits.shape[:-1] != targets.shape or logits.dim() != 3:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [B, T, V] with targets {tuple(targets.shape)} [B, T]"
        )
    out = []
    for s, e in _chunks(logits.shape[1], chunk):
        x = _scaled(logits[:, s:e], temperature)
        picked = x.gather(-1, targets[:, s:e].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(x, dim=-1))
    return torch.cat(out, dim=1) if len(out) != 1 else out[0]


def entropy(logits: Tensor, *, temperature: float = 1.0, chunk: int | None = None) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position, H = logsumexp(x) - sum(p * x).

    The entropy bonus/diagnostic of actor-critic methods (Mnih et al. 2016, "Asynchronous Methods for
    Deep Reinforcement Learning"). logits [B, T, V] -> [B, T] float32; temperature <= 0 means 1;
    `chunk` as in `token_logprobs`.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    out = []
    for s, e in _chunks(logits.shape[1], chunk):
        x = _scaled(logits[:, s:e], temperature)
        p = torch.softmax(x, dim=-1)
        out.append(torch.logsumexp(x, dim=-1) - (p * x).sum(-1))
    return torch.cat(out, dim=1) if len(out) != 1 else out[0]


def kl(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimator of KL(pi || ref) from tokens sampled from pi.

    J. Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with
    d = logprobs - ref_logprobs: k1 = d (unbiased, high variance, can be negative), k2 = d^2 / 2 (biased,
    low variance), k3 = exp(-d) - 1 + d (unbiased and always >= 0). Inputs of one shape (e.g. [B, T]);
    returns that shape, unmasked (aggregate it with `aggregate`).
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_KINDS)}")


@dataclass
class PolicyLoss:
    """A scalar loss to call backward on, and detached diagnostics as python floats."""

    loss: Tensor
    metrics: dict[str, float]


def _metrics(ratio: Tensor, low: Tensor, high: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    """Token-level diagnostics over masked tokens, fetched from the device in one transfer; all 0.0
    when the mask is empty. low/high: tokens whose loss was cut by clipping below/above the band."""
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp_min(1).float()
        ratio, log_ratio = ratio.detach().float(), log_ratio.detach().float()
        frac_low = (low & m).sum().float() / n
        frac_high = (high & m).sum().float() / n
        k3 = torch.where(m, torch.expm1(log_ratio) - log_ratio, 0.0)
        # -inf when the mask is empty; replaced by 0.0 below (no host sync to test for it here)
        ratio_max = torch.where(m, ratio, -torch.inf).amax() if m.numel() else ratio.new_zeros(())
        values = torch.stack(
            [
                frac_low + frac_high,
                frac_low,
                frac_high,
                torch.where(m, ratio, 0.0).sum() / n,
                ratio_max,
                k3.sum() / n,
            ]
        ).tolist()
    values = [v if v != -float("inf") else 0.0 for v in values]
    keys = (
        "clip_fraction",
        "clip_fraction_low",
        "clip_fraction_high",
        "ratio_mean",
        "ratio_max",
        "approx_kl",
    )
    return dict(zip(keys, values, strict=True))


def _token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    if advantages.shape == mask.shape[:1]:
        advantages = advantages.unsqueeze(-1).expand(mask.shape)
    elif advantages.shape != mask.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] or [B, T] for mask {tuple(mask.shape)}"
        )
    return torch.where(mask.bool(), advantages, 0.0)


def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate, per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; separate lower and upper bounds
    ("clip-higher") from DAPO, Yu et al. 2025; `dual_clip=c` (> 1) from Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep Reinforcement Learning", caps the loss of tokens with A < 0
    at -c * A so that a huge ratio cannot blow it up.

    logprobs, old_logprobs, mask [B, T]; advantages [B] (broadcast over tokens) or [B, T]. ratio =
    exp(logprobs - old_logprobs). Reduced with `aggregate(.., aggregation, normalizer)`.
    Metrics over masked tokens: clip_fraction_low / _high are the fractions of tokens whose loss is a
    clipped constant (zero gradient) with the ratio below / above the band (tokens capped by the dual
    clip count as high), clip_fraction their sum; ratio_mean, ratio_max; approx_kl, the k3 estimate of
    KL(old || new) = mean(exp(new - old) - 1 - (new - old)).
    """
    m = mask.bool()
    per_token, ratio, low, high, log_ratio = _ppo_tokens(
        logprobs, old_logprobs, advantages, m, clip_low, clip_high, dual_clip
    )
    loss = aggregate(per_token, m, aggregation, normalizer)
    return PolicyLoss(loss, _metrics(ratio, low, high, log_ratio, m))


def _ppo_tokens(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    m: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO loss [B, T] and (ratio, clipped-low, clipped-high, log-ratio) for the metrics."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    # zero masked log-ratios before exp: exp(huge) is inf, and inf * 0 in backward is nan
    log_ratio = torch.where(m, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    adv = _token_advantages(advantages, m)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        cut = clipped > unclipped
        low = cut & (ratio < 1.0 - clip_low)
        high = cut & (ratio > 1.0 + clip_high)
    if dual_clip is not None:
        cap = -dual_clip * adv
        capped = (adv < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
        high = high | capped.detach()
    return per_token, ratio, low, high, log_ratio


def importance_weights(
    target_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float | None
) -> tuple[Tensor, dict[str, float]]:
    """Per-token importance weights target / behaviour, truncated at `cap`, without gradient.

    Truncation bounds the variance of off-policy corrections (Espeholt et al. 2018, "IMPALA"; for RL
    on language models, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"). Returns (weights [B, T], 0 at masked positions; metrics is_weight_mean, is_weight_max,
    is_truncated_fraction over masked tokens, computed before truncation for the mean and max).
    """
    m = mask.bool()
    with torch.no_grad():
        raw = torch.exp(torch.where(m, target_logprobs - behaviour_logprobs, 0.0).float())
        weights = raw if cap is None else torch.clamp(raw, max=cap)
        weights = torch.where(m, weights, 0.0)
        n = m.sum().clamp_min(1).float()
        truncated = (m & (raw > cap)).sum().float() / n if cap is not None else raw.new_zeros(())
        stats = torch.stack(
            [
                torch.where(m, raw, 0.0).sum() / n,
                torch.where(m, raw, -torch.inf).amax() if m.any() else raw.new_zeros(()),
                truncated,
            ]
        ).tolist()
    return weights, dict(
        zip(("is_weight_mean", "is_weight_max", "is_truncated_fraction"), stats, strict=True)
    )


def decoupled_ppo(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 5.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> PolicyLoss:
    """Decoupled PPO: clip the ratio against a proximal policy, correct behaviour -> proximal by
    importance weights.

    Hilton et al. 2022, "Batch size-invariance for policy optimization"; used for asynchronous RL of
    language models by AReaL (Fu et al. 2025). Per token: w * PPO-clip(exp(logprobs - proximal)), with
    w = min(exp(proximal - behaviour), cap) detached. The behaviour policy generated the sample (maybe
    several versions ago); the proximal policy is the trainer's recomputation with the weights at the
    start of the update, so the trust region is measured from recent weights, not stale ones.
    All [B, T]; advantages [B] or [B, T]. Metrics of `ppo_clip` (ratio = current / proximal) plus
    those of `importance_weights`.
    """
    m = mask.bool()
    per_token, ratio, low, high, log_ratio = _ppo_tokens(
        logprobs, proximal_logprobs, advantages, m, clip_low, clip_high, dual_clip
    )
    weights, w_stats = importance_weights(proximal_logprobs, behaviour_logprobs, m, cap=cap)
    loss = aggregate(weights * per_token, m, aggregation, normalizer)
    return PolicyLoss(loss, {**_metrics(ratio, low, high, log_ratio, m), **w_stats})


def tis(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> PolicyLoss:
    """Truncated importance sampling policy gradient, no ratio clipping.

    Per token: -min(exp(logprobs - behaviour), cap).detach() * A * logprobs, an unbiased (up to the
    truncation) off-policy REINFORCE estimator (Espeholt et al. 2018, "IMPALA": truncated importance
    weights). All [B, T]; advantages [B] or [B, T]. Metrics: those of `importance_weights`, plus
    ratio_mean / ratio_max / approx_kl between behaviour and current, and clip fractions of 0.
    """
    m = mask.bool()
    weights, w_stats = importance_weights(logprobs, behaviour_logprobs, m, cap=cap)
    adv = _token_advantages(advantages, m)
    per_token = -weights * adv * torch.where(m, logprobs, 0.0)
    loss = aggregate(per_token, m, aggregation, normalizer)
    log_ratio = torch.where(m, logprobs - behaviour_logprobs, 0.0).detach()
    none = torch.zeros_like(m)
    return PolicyLoss(loss, {**_metrics(torch.exp(log_ratio), none, none, log_ratio, m), **w_stats})


def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    normalizer: float | None = None,
) -> PolicyLoss:
    """Group Sequence Policy Optimization: PPO clipping on a length-normalised sequence ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization". s_i = exp(mean over row i's valid tokens of
    (logprobs - old_logprobs)); loss = -(1 / (normalizer or B)) * sum_i min(s_i A_i, clip(s_i, 1 -
    clip_low, 1 + clip_high) A_i).

    Implemented in the paper's token-level form (GSPO-token): s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]),
    whose value is s_i at every token, and the clipped term is averaged over the row's tokens. Its value
    and, with one advantage per row, its gradient s_i A_i * mean_t grad logp_t equal the sequence form's.
    logprobs, old_logprobs, mask [B, T]; advantages [B]. Rows without valid tokens contribute 0.
    Metrics as in `ppo_clip`, per token, each token carrying its sequence's ratio and clipping;
    approx_kl uses the per-token log-ratios.
    """
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(mask.shape[:1])}, got {tuple(advantages.shape)}")
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0.0)
    count = m.sum(-1).clamp_min(1).to(log_ratio.dtype)
    seq_ratio = torch.exp(log_ratio.sum(-1) / count)  # [B]
    safe_logprobs = torch.where(m, logprobs, 0.0)
    token_ratio = seq_ratio.detach().unsqueeze(-1) * torch.exp(safe_logprobs - safe_logprobs.detach())
    adv = _token_advantages(advantages, m)
    unclipped = -adv * token_ratio
    clipped = -adv * torch.clamp(token_ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, m, "seq-mean-token-mean", normalizer)
    with torch.no_grad():
        cut = clipped > unclipped
        low = cut & (token_ratio < 1.0 - clip_low)
        high = cut & (token_ratio > 1.0 + clip_high)
    return PolicyLoss(loss, _metrics(token_ratio, low, high, log_ratio, m))


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO, Schulman et al. 2017; the clipping as in its reference code).

    0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -clip, clip): the value
    may not move further than `clip` from the value the advantages were computed with, unless that
    makes the error smaller. clip None is the plain squared error. values, old_values, returns and mask
    [B, T]. Returns (loss, {clip_fraction, explained_variance}) aggregated like the policy loss.
    """
    m = mask.bool()
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        worse = err_clipped > err
        err = torch.maximum(err, err_clipped)
    else:
        worse = torch.zeros_like(m)
    loss = 0.5 * aggregate(err, m, aggregation, normalizer)
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        r = torch.where(m, returns, 0.0)
        resid = torch.where(m, returns - values, 0.0)
        r_var = (r * r).sum() / n - (r.sum() / n) ** 2
        e_var = (resid * resid).sum() / n - (resid.sum() / n) ** 2
        metrics = {
            "value_clip_fraction": float((worse & m).sum() / n),
            "explained_variance": float(1 - e_var / r_var) if float(r_var) > 0 else 0.0,
        }
    return loss, metrics


class AdaptiveKL:
    """A KL coefficient that tracks a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", section 2.2): after each step with measured KL k over n samples,
    coef *= 1 + clip(k / target - 1, -0.2, 0.2) * n / horizon. With target None the coefficient is fixed.
    """

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        self.coef = coef
        self.target = target
        self.horizon = horizon

    def update(self, measured: float, n: int) -> float:
        if self.target is not None and self.coef > 0:
            error = min(max(measured / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n / self.horizon
        return self.coef
