"""The evidence bundle's part on generation (issue 28): the summary's win-rate section, and `report verify`'s check.

The judge stage's three outputs are packed (stages/lib/layout.py `judge`): judgments.jsonl (one row per prompt and
sample), metrics/generation.json and judge_summary.json. summary.md gains `render_generation_section` (the
win-rate table, the length view and three probe prompts with both completions side by side, escaped and cut for
display), remade by verify like the rest of the summary; `check_generation` reruns
stages/evidence/scoring.py evaluate_generation (the win-rate bootstrap, the length view, the KL estimate) on the packed
rows and compares the metrics and the summary's bootstrap with the packed ones. Kept apart from evidence.py and
stages/evidence/verify.py, which call these two functions and nothing else of this module.
"""
from __future__ import annotations

import html
import json
from typing import Any

from stages.evidence.compare import numbers_agree
from stages.lib.layout import STAGE_OUTPUTS

JUDGE = STAGE_OUTPUTS["judge"]
SHOWN_PROMPTS = 3          # probe prompts shown side by side in the summary
SHOWN_CHARS = 240          # a completion or prompt cut to this many characters for display


def generation_members(packed_json, packed_text) -> dict | None:
    """{"metrics", "summary", "rows"} from a bundle's packed judge outputs (packed_json / packed_text: path ->
    parsed JSON / text, or None when not packed); None when the bundle packs none of them."""
    metrics, summary = packed_json(JUDGE["metrics_generation"]), packed_json(JUDGE["summary"])
    text = packed_text(JUDGE["judgments"])
    if metrics is None and summary is None and text is None:
        return None
    rows = [json.loads(line) for line in text.splitlines() if line.strip()] if text is not None else None
    return {"metrics": metrics, "summary": summary, "rows": rows}


def _f(x: float) -> str:
    return f"{x:.4f}"


def _ci(m: dict, key: str) -> str:
    return f"{_f(m[key])} [{_f(m[key + '_ci_low'])}, {_f(m[key + '_ci_high'])}]"


def display(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text for a markdown table cell: cut to `limit` characters (marked with an ellipsis), HTML-escaped (a
    completion may hold `<|im_end|>` or markup), pipes and backticks neutralised, line breaks as <br>."""
    cut = text if len(text) <= limit else text[:limit] + "…"
    out = html.escape(cut, quote=False).replace("|", "&#124;").replace("`", "&#96;")
    out = out.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
    return out if out.strip() else "<i>(empty)</i>"


def _prompt_text(messages: list[dict]) -> str:
    """The prompt's last user turn, and how many turns came before it."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    text = messages[last]["content"] if messages else ""
    return text + (f"\n(after {last} earlier turn{'s' if last != 1 else ''})" if last > 0 else "")


def _grade(row: dict, side: str) -> str:
    g = row.get(f"{side}_grade")
    if g is None:
        return ""
    return f" <br>(grader: {'pass' if g['success'] else 'fail'}{': ' + ', '.join(g['labels']) if g['labels'] else ''})"


def render_generation_section(generation: dict | None, params: dict) -> list[str]:
    """summary.md's lines on generation; [] when the bundle has none."""
    if not generation or generation.get("metrics") is None:
        return []
    m, rows, gen = generation["metrics"], generation.get("rows") or [], params["generation"]
    ev = params["evaluate"]
    judge = "the trained reward model" if gen["judge"] == "trained" else \
        f"{gen['judge']['repo_id']} @ {gen['judge']['revision']}"
    policy = "The trained DPO policy" if gen["policy"] == "trained" else \
        f"{gen['policy']['repo_id']} @ {gen['policy']['revision']}"
    sampling = "greedy" if gen["temperature"] == 0 else (
        f"temperature {gen['temperature']}, top_p {gen['top_p']}" + (f", top_k {gen['top_k']}" if gen.get("top_k") else ""))
    if gen.get("repetition_penalty", 1.0) != 1.0:
        sampling += f", repetition penalty {gen['repetition_penalty']}"
    better = "yes" if m["win_rate_ci_low"] > 0.5 else "no"
    length, kl = m["length"], m.get("kl")
    kl_cells = (f"{_ci(kl, 'per_completion')} | {_f(kl['per_token'])}" if kl is not None
                else "n/a (greedy) | n/a")
    lines = ["## Generation: policy against reference", "",
             f"{policy} and the reference each wrote {m['samples_per_prompt']} completion(s) of each of the "
             f"{m['n_prompts']} probe prompts ({sampling}, at most {gen['max_new_tokens']} new tokens, seed "
             f"{gen['seed']}). Judge: {judge}. {int(round(ev['confidence'] * 100))}% paired percentile "
             f"bootstrap intervals over prompts ({ev['bootstrap_replicates']} replicates, seed {ev['seed']}).", "",
             "| win rate [CI] | policy better | ties | reward difference [CI] | at equal length [CI] | "
             "KL per completion [CI] | KL per token | mean length policy / reference |",
             "|---|---|---|---|---|---|---|---|",
             f"| {_ci(m, 'win_rate')} | {better} | {m['ties']} | {_ci(m, 'reward_diff')} | "
             f"{_ci(length, 'reward_diff_at_equal_length')} | {kl_cells} | "
             f"{length['policy_mean']:.2f} / {length['reference_mean']:.2f} |", "",
             "A tie counts 0.5; the policy is better when the win rate's lower bound is above 0.5. \"At equal "
             "length\": the reward difference a least-squares fit on the length difference predicts for equal "
             f"lengths (slope {_f(length['reward_diff_per_token'])} per token). KL: the policy's log-ratio to the "
             "reference over its own completions, an estimate of KL(policy || reference) only when sampled at "
             "temperature 1 (greedy completions are no sample: no KL is shown).", "",
             *warning_lines(m, gen), *grader_lines(m, ev),
             "| length ratio (policy + 1) / (reference + 1) | pairs | win rate | reward difference |",
             "|---|---|---|---|"]
    bounds = {"policy_shorter": "below 0.8", "similar": "0.8 to 1.25", "policy_longer": "above 1.25"}
    order = [k for k in bounds if k in length["buckets"]] + sorted(set(length["buckets"]) - set(bounds))
    for name in order:
        b = length["buckets"][name]
        # an empty bucket's means are null (prefpipe-generation-metrics/1 writes every field)
        lines.append(f"| {bounds.get(name, name)} | {b['pairs']} | "
                     f"{_f(b['win_rate']) if b.get('win_rate') is not None else '-'} | "
                     f"{_f(b['reward_diff']) if b.get('reward_diff') is not None else '-'} |")
    shown = [r for r in rows if r.get("sample") == 0][:SHOWN_PROMPTS]
    if shown:
        lines += ["", f"### The first {len(shown)} probe prompts", ""]
    for r in shown:
        lines += [f"**Prompt {r['index']}** (pair `{r['pair_id']}`): {display(_prompt_text(r['prompt']))}", "",
                  f"| policy: reward {_f(r['policy_reward'])}, {r['policy_length']} tokens, "
                  f"{r['policy_stop_reason']} | reference: reward {_f(r['reference_reward'])}, "
                  f"{r['reference_length']} tokens, {r['reference_stop_reason']} |",
                  "|---|---|",
                  f"| {display(r['policy_completion'])}{_grade(r, 'policy')} | "
                  f"{display(r['reference_completion'])}{_grade(r, 'reference')} |", ""]
    return lines + [""]


WARNINGS = {
    "judge_trained_on_same_pairs": "the judge is the reward model trained on the same preference pairs as the "
                                   "policy: it measures agreement with those pairs, not quality",
    "all_hit_max_new_tokens": "every completion of both sides ran to max_new_tokens: no model finished an answer",
    "length_mismatch": "the two sides' mean lengths differ by more than half: a judge that prefers length "
                       "decides the win rate",
    "judge_disagrees_with_grader": "the judge disagrees with the grader on more than a quarter of the prompts where "
                                   "the two completions grade differently",
}
# The warnings that make the win rate no evidence (the first only qualifies it).
NOT_EVIDENCE = ("all_hit_max_new_tokens", "length_mismatch", "judge_disagrees_with_grader")


def warning_lines(m: dict, gen: dict) -> list[str]:
    codes = m.get("warnings") or []
    if not codes:
        return []
    fatal = [c for c in codes if c in NOT_EVIDENCE]
    head = ("**The win rate above is not evidence that the policy is better**, because:" if fatal else
            "**Read the win rate with care:**")
    return [head, "", *[f"- {WARNINGS.get(c, c)} (`{c}`)" for c in codes], ""]


def grader_lines(m: dict, ev: dict) -> list[str]:
    g = m.get("grader")
    if not g:
        return []
    ci = int(round(ev["confidence"] * 100))
    agreement = "-" if g["judge_agreement"] is None else _f(g["judge_agreement"])
    labels = sorted(set(g["labels"]["policy"]) | set(g["labels"]["reference"]))
    lines = [f"### Graded by `{g['name']}` (a programmatic check, independent of the training pairs)", "",
             f"| graded success policy [CI] | reference [CI] | difference [CI] | prompts graded differently | "
             f"judge agrees with the grader there |", "|---|---|---|---|---|",
             f"| {_ci(g, 'policy_success')} | {_ci(g, 'reference_success')} | {_ci(g, 'success_diff')} | "
             f"{g['differing']} | {agreement} |", "",
             f"{ci}% paired percentile bootstrap over prompts (the win rate's resamples). The judge agrees when it "
             "gives the higher reward to the completion the grader passes (a tie counts 0.5).", ""]
    if labels:
        lines += ["| label | policy | reference |", "|---|---|---|"]
        lines += [f"| {lab} | {_f(g['labels']['policy'].get(lab, 0.0))} | {_f(g['labels']['reference'].get(lab, 0.0))} |"
                  for lab in labels]
        lines.append("")
    return lines


# Keys of judge_summary.json that evaluate_generation makes (the rest: the judge's record, definitions).
RECOMPUTED_SUMMARY_KEYS = ("n_prompts", "samples_per_prompt", "index_matrix", "bootstrap", "length_buckets",
                           "policy_better")


def check_generation(v, b) -> None:
    """`report verify`: metrics/generation.json and judge_summary.json's bootstrap recomputed from the packed
    judgments by evaluate_generation (floats to the verify tolerance). Missing members are _check_layout's."""
    from stages.evidence.scoring import PerPairFileError, evaluate_generation
    generation = generation_members(b.packed_json, lambda rel: None if b.packed(rel) is None else b.packed(rel).decode())
    if generation is None or generation["rows"] is None or generation["metrics"] is None:
        v.add(False, JUDGE["metrics_generation"], "the bundle packs no judgments and generation metrics to recompute")
        return
    try:
        metrics, summary = evaluate_generation(generation["rows"], b.params, JUDGE["judgments"])
    except (PerPairFileError, KeyError, ValueError, TypeError) as e:
        v.add(False, JUDGE["metrics_generation"], f"judgments refused: {e}")
        return
    diffs: list[str] = []
    numbers_agree(generation["metrics"], metrics, JUDGE["metrics_generation"], diffs)
    v.diffs(JUDGE["metrics_generation"], diffs, f"win-rate bootstrap recomputed from {JUDGE['judgments']}")
    packed: Any = generation["summary"] or {}
    diffs = []
    numbers_agree({k: packed.get(k) for k in RECOMPUTED_SUMMARY_KEYS}, {k: summary[k] for k in RECOMPUTED_SUMMARY_KEYS},
                   JUDGE["summary"], diffs)
    v.diffs(JUDGE["summary"], diffs, "bootstrap bounds and index matrix recomputed")
