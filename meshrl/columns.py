"""The names of the data plane's partitions and columns that services share: the contract between them.

Every service adds columns to rows; none calls another (docs/architecture.md, "Roles and columns"):

    samples   one row per completion
              rollout      PROMPT; then REWARD, ADVANTAGE, VALID (+ RETURNS for GAE from a critic;
                           TOKEN_REWARDS instead of ADVANTAGE with the trainer's value head)
              inference    RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH
              reference    REF_LOGPROBS          reward model  RM_SCORE
              critic       VALUES                teacher       teacher_columns(prefix)
              env          a whole trajectory at once (agents): PROMPT, RESPONSE, LOGPROBS, LOSS_MASK,
                           TOKEN_VERSIONS, VERSION, GEN_S, GEN_BATCH, ENV_REWARD
    tasks     agents: rollout's trajectory starts (PROMPT: the dataset prompt, for the record)
    turns     agents: one row per turn; env writes PROMPT (the trajectory's ids so far) and its history
              (LOSS_MASK, TRAJ_LOGPROBS, TOKEN_VERSIONS after the first context), inference GENERATED
    eval      the same flow for held-out prompts (PROMPT, then inference's columns)
    gate      the trainer's published weight versions (VERSION), which pace rollout
    control   run-wide events (EVENT: FINISHED or FAILED)
    checkpoint, checkpoint_acks   the checkpoint protocol (STEP; meshrl/state/checkpoint.py)
"""

from __future__ import annotations

# partitions
SAMPLES = "samples"
EVAL = "eval"
GATE = "gate"
CONTROL = "control"
CHECKPOINT = "checkpoint"
CHECKPOINT_ACKS = "checkpoint_acks"
TASKS = "tasks"
TURNS = "turns"

# columns of samples (and eval)
PROMPT = "prompt"
"""Prompt token ids."""
RESPONSE = "response"
"""Generated token ids, the stop token included."""
LOGPROBS = "logprobs"
"""Behaviour log-probability of each response token, under logits / temperature."""
VERSION = "version"
"""[first, last] weight version the response was generated with (in `gate`: the published version)."""
GEN_S = "gen_s"
"""Seconds of the inference batch that generated the row."""
GEN_BATCH = "gen_batch"
"""Id of that inference batch."""
REWARD = "reward"
ADVANTAGE = "advantage"
"""One per sample, or one per response token (GAE)."""
VALID = "valid"
"""False when the reward could not be computed: the sample is left out of the loss."""
RETURNS = "returns"
TOKEN_REWARDS = "token_rewards"
"""Per-token rewards, for the trainer's value head to compute advantages from."""
REF_LOGPROBS = "ref_logprobs"
RM_SCORE = "rm_score"
VALUES = "values"

LOSS_MASK = "loss_mask"
"""Per response token: 1 on the model's tokens, 0 on the environment's (multi-turn samples only)."""
TOKEN_VERSIONS = "token_versions"
"""Per response token: the weight version that generated it (-1: the environment's)."""
TRAJ_LOGPROBS = "traj_logprobs"
"""In `turns`: the behaviour logprobs of the trajectory's tokens so far (0 on the environment's)."""
ENV_REWARD = "env_reward"
"""The environment's reward of a trajectory (NaN: the environment failed; the sample is invalid)."""

GENERATED = (RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH)
"""What inference writes."""

# other partitions' columns
EVENT = "event"
"""In `control`: FINISHED (training is over, every service exits) or FAILED (a service gave up)."""
FINISHED, FAILED = 1, 2
STEP = "step"


def teacher_columns(prefix: str) -> tuple[str, str, str]:
    """The columns a teacher writes: top-k ids and logprobs ([response_len, k] per row) and the logprob
    of each sampled response token ([response_len])."""
    return f"{prefix}_topk_ids", f"{prefix}_topk_logprobs", f"{prefix}_logprobs"
