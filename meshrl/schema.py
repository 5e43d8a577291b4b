"""The data plane's partitions, columns and row metadata that services share: the contract between them.

Every service adds columns to rows; none calls another (docs/architecture.md, "Roles and columns"). The
planner wires a run from what each config declares it reads and writes (`meshrl/planning/wiring.py`);
these are the names those declarations use:

    samples   one row per completion
              rollout      PROMPT; then REWARD, ADVANTAGE, VALID (+ RETURNS for GAE from a critic;
                           TOKEN_REWARDS instead of ADVANTAGE with the trainer's value head)
              inference    RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH
              reference    REF_LOGPROBS          reward model  RM_SCORE
              critic       VALUES                teacher       teacher_columns(prefix)
              env          a whole trajectory at once (agents): PROMPT, RESPONSE, LOGPROBS, LOSS_MASK,
                           TOKEN_VERSIONS, VERSION, GEN_S, GEN_BATCH, ENV_REWARD
              agents       the same for an agent program's session, and SEGMENTS
    tasks     agents: rollout's trajectory starts (PROMPT, and the dataset row as TASK metadata)
    turns     agents: one row per turn; env writes PROMPT (the trajectory's ids so far) and its history
              (LOSS_MASK, TRAJ_LOGPROBS, TOKEN_VERSIONS after the first context), inference GENERATED
    calls     agents' model calls through the endpoint (black-box agents): one row per call; the
              endpoint writes PROMPT (the rendered request) with SAMPLING, SESSION and TO metadata,
              inference GENERATED, the endpoint DELIVERED once the caller has the answer; the
              agents service reads the delivered calls of its sessions into trajectories
    eval      the same flow for held-out prompts (PROMPT, then inference's columns)
    gate      the trainer's published weight versions (VERSION), which pace rollout
    control   run-wide events (EVENT: FINISHED or FAILED)
    checkpoint, checkpoint_acks   the checkpoint protocol (STEP; meshrl/state/checkpoint.py)
    ring.<id>.<launch>            a colocation ring's requests, releases, grants (meshrl/runtime/colocation.py)

Besides its columns a row carries metadata, a small dict (the keys below): who it belongs to and what
it may be generated with. The data plane reads two keys itself: GROUP, for whole-group claims, and TO,
for claims of the rows addressed to one replica.
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
CALLS = "calls"

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

SEGMENTS = "segments"
"""Optional, per sample: the lengths of the independent token sequences its prompt + response hold (an
agent's trajectory whose history was rewritten between calls; meshrl/envs/sessions.py). Each is trained
as a sequence of its own (positions restart, no token attends across), under the sample's reward."""

DELIVERED = "delivered"
"""In `calls`: 1 when the caller got the answer, 0 when nobody was waiting for it any more (the endpoint
replica that took the call restarted): the agents service leaves it out of the trajectory."""

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


# row metadata (a row's `meta`)
GROUP = "group"
"""int: the sampling group (one prompt drawn, `group_size` completions) a row belongs to; the data
plane's whole-group claims group by it. Replica k of rollout numbers its groups from k * 10**12."""
MEMBER = "member"
"""int: the row's index in its group (evaluation rows: its index among a prompt's rows)."""
PROMPT_ID = "prompt_id"
"""int: the index of the dataset row the prompt came from."""
EPOCH = "epoch"
"""int: the pass over the dataset the prompt was drawn in."""
MIN_VERSION = "min_version"
"""int: the oldest weight version the row may be generated with (rollout's pacing; inference holds
the row until that version is in)."""
TASK = "task"
"""str: the dataset row itself as JSON text, on the rows rollout feeds: an environment resets from it."""
EVAL_VERSION = "eval_version"
"""int: on an evaluation row, the weight version evaluated."""
GREEDY = "greedy"
"""bool: on an evaluation row, generate it greedily."""
TURN = "turn"
"""int: on a turn row, how many model turns the trajectory has had (it seeds the turn's sampling)."""
BY = "by"
"""str: on control, checkpoint-ack and ring rows, the process that wrote it."""
FINAL = "final"
"""bool: on a gate row, the last version of the run."""
TO = "to"
"""str: the replicas a row is addressed to, joined by commas (`<group>-<index>`, a replica's name): a claim with an
address gets only the rows whose TO names it (the endpoint replica that must answer a call, the
agents replica whose session made it)."""
SESSION = "session"
"""str: on a call row, the session (one agent program's run) that made it."""
SAMPLING = "sampling"
"""str: on a call row, what the caller asked for, as a JSON object: temperature, top_p, max_tokens, seed
(each optional: the run's own settings fill the rest)."""
CARRIED = (GROUP, MEMBER, PROMPT_ID, EPOCH, MIN_VERSION)
"""What a trajectory's turn rows and its finished sample keep of the row that started it."""
MODEL_TURNS = "model_turns"
"""int: on an agent's sample, the model turns (calls) of its trajectory; the trainer reports them."""
SEQUENCES = "sequences"
"""int: on an agent program's sample, its segments (1: every call joined the one before)."""
TRUNCATED = "truncated"
"""str | None: on an environment's sample, the limit the trajectory ran into: "turns" or "tokens"."""
TRAJ_FAILED = "failed"
"""bool: on an agent's sample, the environment or program failed (its reward is NaN)."""
TOOL_CALLS = "tool_calls"
"""int: on an environment's sample, the tool calls its steps ran (`call_tools`; malformed ones included)."""
TOOL_ERRORS = "tool_errors"
"""str: on an environment's sample, its tool errors by kind, a JSON object over TOOL_ERROR_KINDS."""
TOOL_ERROR_KINDS = ("malformed", "unknown_tool", "arguments", "raised", "timeout")
"""A tool call that did not parse, named no tool, had bad arguments, raised, or ran out of time."""
ENV_REWARDS = "env_rewards"
"""str: on an agent's sample, the environment's (or program's) named reward parts, a JSON object."""
ENV_S = "env_s"
"""float: on an agent's sample, seconds its trajectory spent in the environment (or program)."""
QUEUED_S = "queued_s"
"""float: on an agent's sample, seconds its trajectory was neither generating nor in the environment
(waiting for a generation slot, an env slot, or the data plane)."""

# colocation rings (one partition per ring and launch)
RING_CAPACITY = 4096
GRANT = "grant"
"""In a ring partition: on a request row, the turn it was granted."""
PREEMPT = "preempt"
"""In a ring partition: on a holder's request row, the turn whose holder is asked to leave."""
REQUEST, RELEASE = 1, 2
"""The kinds of a ring row's EVENT."""


def ring_partition(ring: str, launch: str) -> str:
    """The partition of colocation ring `ring` in launch `launch`."""
    return f"ring.{ring}.{launch}"
