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

max_length may not exceed the reference's positions (`max_position_embeddings` in its config.json): a longer
sequence would put tokens at positions the model has no embedding for, or never learned. check_fits_reference
refuses it, naming both numbers and the file; the Snakefile's pre-flight runs it at DAG build (when the reference
directory is there), tokenize and freeze_probe again on the verified directory (load_limits).

TRUNCATION_REASONS are the codes of a kept, truncated pair (the report's `truncated_by_reason`, the probe token
manifest's `truncated[].reason`); a pair that cannot be kept is a rejection (`prompt_too_long`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages.lib.io import display_path
from stages.lib.reference import max_positions

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


def check_fits_reference(max_length: int, ref_dir: str | Path) -> None:
    """TokenizeError when tokenize.max_length is over the positions of the reference in ref_dir."""
    found = max_positions(ref_dir)
    if found is not None and max_length > found[0]:
        positions, key, path = found
        raise TokenizeError(f"tokenize.max_length {max_length} is more than the reference's {key} {positions} "
                            f"({display_path(path)}): the model has no position past {positions - 1}; set "
                            f"tokenize.max_length to at most {positions}")


def load_limits(tok_params: dict, ref_dir: str | Path) -> TokenizeLimits:
    """params.yaml's `tokenize` section as limits, checked on their own and against the reference in ref_dir."""
    limits = TokenizeLimits.from_params(tok_params)
    check_fits_reference(limits.max_length, ref_dir)
    return limits
