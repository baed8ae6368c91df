"""Steps bounded in time: how many prompt tokens a step may prefill beside the running decodes.

On a CPU a prefill chunk of thousands of tokens takes seconds, and every sequence decoding beside it
waits that long for its next token. A step-time target (`max_step_ms`) bounds that wait: the pacer
learns this machine's cost of a decode step and of a prefill token from the steps it sees (as the
tiers learn their deadlines), and gives each step only the prefill tokens that fit in the target
beside the decodes it carries. With nothing decoding, prefill gets the whole token budget, so a
lone long prompt runs at full speed (Sarathi-Serve's stall-free batching, with the budget from time).

Chunking never changes a token's bits (batch invariance), only when it is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

#: weight of the newest observation in the running estimates: a few steps to follow a change
SMOOTHING = 0.2
#: prefill cost per token assumed before any prefill step was seen (a 135M model on 2 cores is ~2 ms)
FIRST_TOKEN_COST_S = 0.002


@dataclass
class StepPacer:
    """Sizes each step's prefill from `target_s` and the costs it has learned.

    `max_tokens` is the step's token budget (max_num_batched_tokens); `min_tokens` the least prefill a
    step carries when decodes alone fill the target, so that prompts always progress.
    """

    target_s: float
    max_tokens: int
    min_tokens: int
    #: seconds of a step that only decodes (its rows' fixed cost: weights, attention, Python)
    decode_step_s: float | None = None
    #: seconds per prefill token beyond that (None: none seen yet, FIRST_TOKEN_COST_S assumed)
    token_s: float | None = None
    #: steps that carried decodes, and those of them that took longer than the target
    num_paced_steps: int = 0
    num_steps_over_target: int = 0

    def prefill_budget(self, decode_rows: int) -> int:
        """Prompt tokens the next step may compute beside `decode_rows` decoding sequences."""
        if decode_rows == 0:
            return self.max_tokens
        room = self.target_s - (self.decode_step_s or 0.0)
        per_token = self.token_s if self.token_s is not None else FIRST_TOKEN_COST_S
        return max(self.min_tokens, min(self.max_tokens, int(room / per_token)))

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """Learn from a step that computed `prefill_tokens` prompt tokens beside `decode_rows` decodes
        in `seconds`."""
        if decode_rows:
            self.num_paced_steps += 1
            self.num_steps_over_target += seconds > self.target_s
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_step_s = _blend(self.decode_step_s, seconds)
            return
        beside = self.decode_step_s if decode_rows and self.decode_step_s is not None else 0.0
        self.token_s = _blend(self.token_s, max(seconds - beside, 0.0) / prefill_tokens)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
