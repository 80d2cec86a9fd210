"""The data side: what normalize, freeze_probe and tokenize run. Read it in this order:

    messages.py        the vocabulary of a pair: messages, the conversation rules, implicit prompts, the reason
                       codes every format shares, and `Format` (what a format module declares)
    formats/           one module per source format (hh, trl, sharegpt, openai, columns), found by the registry
                       in formats/__init__.py: detection (`auto`), parsing, its own reason codes, its options
    sources.py         a source's files (file kinds, globs, directories of shards), names, rows as read
    spill.py           the on-disk sort of pairs by pair_id, and the table sinks the streaming writers use
    render.py          a conversation rendered as text (the tokenizer's chat template, or plain role tags)
    tokenizer.py       loading the tokenizer, its identity, and what its parts prove (the characters-per-token
                       bound, exact cuts at spaces)
    limits.py          `tokenize` params: lengths, truncation modes and their reason codes, the reference's positions
    pair_tokenizer.py  one pair's branches rendered and encoded, the prompt/completion boundary on tokens
    truncation.py      pairs -> token rows under the limits: every truncation mode, rejections, truncation records
    pool.py            the forked worker pool (sized to the input, results in input order, dies with the stage)

Layers: this package imports stages.lib only; stages import it; it never imports a stage or stages.engine (the
engine and the data side meet only through stages.lib's contracts: the pair and token schemas and hashes).
The package has no code here, so a stage depends (workflow/code_deps.py) only on the modules it imports.
"""
