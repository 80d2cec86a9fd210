"""`tokenize` params as the data side reads them: the length limits and the truncation mode.

    max_length          tokens of a whole branch (prompt + one completion)
    max_prompt_length   tokens of the prompt; < max_length, so a prompt that fits leaves room for a completion
    truncation          what happens to a pair over a limit (stages/data/truncation.py):
        reject                  reason-coded rejection: `prompt_too_long` / `sequence_too_long`
        truncate_completion     completions cut to max_length (`completion_cut`); a prompt over is rejected
        keep_end                completions whole; the prompt loses its oldest turns, or its last user turn's
                                leading text (`prompt_turns_dropped`, `prompt_text_cut`)
        keep_end_then_completion   the prompt cut from the left as keep_end cuts it, but only to
                                max_prompt_length; then each branch cut to its first max_length tokens
                                (`prompt_turns_dropped` / `prompt_text_cut` / `completion_cut`, or
                                `prompt_and_completion_cut` when both were cut): TRL's keep_end with
                                max_prompt_length and max_completion_length (stages/data/truncation.py says where
                                it differs)

TRUNCATION_REASONS are the codes of a kept, truncated pair (the report's `truncated_by_reason`, the probe token
manifest's `truncated[].reason`); a pair that cannot be kept is a rejection (`prompt_too_long`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

TRUNCATION_POLICIES = ("reject", "truncate_completion", "keep_end", "keep_end_then_completion")
PROMPT_CUTTING = ("keep_end", "keep_end_then_completion")   # the modes that re-render a pair with a shorter prompt
# How a kept pair was cut (probe token manifest `truncated[].reason`, report `truncated_by_reason`).
TRUNCATION_REASONS = ("completion_cut", "prompt_turns_dropped", "prompt_text_cut", "prompt_and_completion_cut")


class TokenizeError(ValueError):
    """The data cannot be tokenized correctly as configured; the message names the file / pairs / key and why."""


@dataclass(frozen=True)
class TokenizeLimits:
    max_length: int
    max_prompt_length: int
    truncation: str

    @classmethod
    def from_params(cls, tok_params: dict) -> "TokenizeLimits":
        limits = cls(int(tok_params["max_length"]), int(tok_params["max_prompt_length"]),
                     str(tok_params["truncation"]))
        if limits.truncation not in TRUNCATION_POLICIES:
            raise TokenizeError(f"tokenize.truncation must be one of {TRUNCATION_POLICIES}, "
                                f"got {limits.truncation!r}")
        # A prompt of max_prompt_length must leave room for at least one completion token.
        if not 1 <= limits.max_prompt_length < limits.max_length:
            raise TokenizeError(f"tokenize.max_prompt_length ({limits.max_prompt_length}) must be "
                                f">= 1 and < tokenize.max_length ({limits.max_length})")
        return limits

    def as_dict(self) -> dict:
        return {"max_length": self.max_length, "max_prompt_length": self.max_prompt_length,
                "truncation": self.truncation}
