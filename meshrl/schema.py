"""The data plane's partitions, columns and row metadata that services share: the contract between them.

Every service adds columns to rows; none calls another (docs/architecture.md, "Roles and columns"). The
planner wires a run from what each config declares it reads and writes (`meshrl/planning/wiring.py`);
these are the names those declarations use:

    samples   one row per completion
              rollout      PROMPT (and IMAGES, IMAGE_MASK, PICTURES for a vision-language model); then REWARD, ADVANTAGE, VALID (+ RETURNS for GAE from a critic;
                           TOKEN_REWARDS instead of ADVANTAGE with the trainer's value head)
              inference    RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH
              reference    REF_LOGPROBS          reward model  RM_SCORE
              critic       VALUES                teacher       teacher_columns(prefix)
              agents       a whole trajectory at once: TRAJECTORY_WRITES
    tasks     agents: rollout's trajectory starts (PROMPT, and the dataset row as TASK metadata)
    calls     agents' model calls, one row per call: the agents service writes PROMPT (an environment's
              turn, or a program's request rendered by the endpoint), addressed (TO) to itself, with
              SAMPLING and SESSION for a program's call, and an environment's trajectory so far
              (TRAJECTORY_SO_FAR, its state in the metadata) so any successor can resume it; inference
              writes GENERATED
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
IMAGES = "images"
"""A vision-language model's prompt images as its processor made them: [n_images, 3, H, W] float32 per row
(n_images may be 0), written once by the service that encoded the prompt (meshrl/models/vision.py)."""
IMAGE_MASK = "image_mask"
"""Per row, the images' pixel masks [n_images, H, W] (False: padding the processor added)."""
PICTURES = "pictures"
"""Per row, the decoded pictures the IMAGES were made from, as raw RGB bytes (uint8, `meshrl.models.pictures`):
for an engine that runs its own image processing (vLLM)."""
REF_LOGPROBS = "ref_logprobs"
RM_SCORE = "rm_score"
VALUES = "values"

LOSS_MASK = "loss_mask"
"""Per response token: 1 on the model's tokens, 0 on everything else (agents' samples only)."""
TOKEN_VERSIONS = "token_versions"
"""Per response token: the weight version that generated it (-1: not the model's)."""
ENV_REWARD = "env_reward"
"""An agent's reward of its trajectory (NaN: the episode failed; the sample is invalid)."""
SEGMENTS = "segments"
"""Per agent's sample: the lengths of the independent token sequences its prompt + response hold (one,
unless a call's history did not extend the one before: meshrl/envs/trajectory.py). Each is trained as a
sequence of its own (positions restart, no token attends across), under the sample's reward."""
EARLIER = "earlier"
"""In `calls`, an environment's call: the trajectory's tokens before the current segment (the call's
PROMPT is that segment); empty unless the trajectory split."""
TRAJ_LOGPROBS = "traj_logprobs"
"""In `calls`, an environment's call: the behaviour log-probs of the trajectory so far, per token after its
first prompt (LOSS_MASK and TOKEN_VERSIONS too, SEGMENTS over EARLIER + PROMPT)."""

GENERATED = (RESPONSE, LOGPROBS, VERSION, GEN_S, GEN_BATCH)
"""What inference writes."""
TRAJECTORY_SO_FAR = (EARLIER, LOSS_MASK, TRAJ_LOGPROBS, TOKEN_VERSIONS, SEGMENTS)
"""What an environment's call row carries of its trajectory besides the call's PROMPT."""
TRAJECTORY_WRITES = (
    PROMPT, RESPONSE, LOGPROBS, LOSS_MASK, TOKEN_VERSIONS, SEGMENTS, VERSION, GEN_S, GEN_BATCH, ENV_REWARD,
)  # fmt: skip
"""The columns of an agent's sample (meshrl/envs/trajectory.py)."""

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
"""int: on an environment's call row, how many model turns the trajectory has had (it seeds the turn's
sampling)."""
BY = "by"
"""str: on control, checkpoint-ack and ring rows, the process that wrote it."""
FINAL = "final"
"""bool: on a gate row, the last version of the run."""
TO = "to"
"""str: the replicas a row is addressed to, joined by commas (`<group>-<index>`, a replica's name): a claim with an
address gets only the rows whose TO names it (the agents replica that made a call takes its answer)."""
SESSION = "session"
"""str: on a program's call row, the session (one program's run) that made it."""
SAMPLING = "sampling"
"""str: on a call row, what the caller asked for, as a JSON object: temperature, top_p, max_tokens, seed
(each optional: the run's own settings fill the rest)."""
CARRIED = (GROUP, MEMBER, PROMPT_ID, EPOCH, MIN_VERSION)
"""What a trajectory's call rows and its finished sample keep of the row that started it."""
MODEL_TURNS = "model_turns"
"""int: on an agent's sample, the model turns (calls) of its trajectory; the trainer reports them."""
SEQUENCES = "sequences"
"""int: on an agent's sample, its segments (1: every call joined the one before)."""
TRUNCATED = "truncated"
"""str | None: on an environment's sample, the limit the trajectory ran into: "turns" or "tokens"."""
TRAJ_FAILED = "failed"
"""bool: on an agent's sample, the episode failed (its reward is NaN)."""
TOOL_CALLS = "tool_calls"
"""int: on an agent's sample, the tool calls of its trajectory: those an environment's steps ran
(`call_tools`), those the endpoint parsed from a program's answers (malformed ones included)."""
TOOL_ERRORS = "tool_errors"
"""str: on an agent's sample, its tool errors by kind, a JSON object over TOOL_ERROR_KINDS (for a
program, only "malformed" is seen: its tools run in its own code)."""
TOOL_ERROR_KINDS = ("malformed", "unknown_tool", "arguments", "raised", "timeout")
"""A tool call that did not parse, named no tool, had bad arguments, raised, or ran out of time."""
ENV_REWARDS = "env_rewards"
"""str: on an agent's sample, the environment's (or program's) named reward parts, a JSON object."""
ENV_S = "env_s"
"""float: on an agent's sample, seconds its trajectory spent in the environment (a program: its own time)."""
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
