"""Packing: token parquet validation, micro-batch plans, and the tensors of a packed batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import random_rows, token_row, write_token_parquet
from stages.engine.packing import (BatchDims, TokenDataError, assign_pairs_to_ranks, build_packed_batch,
                                load_token_pairs, pack_micro_batches, plan_inference, plan_training)
from stages.engine.padded_shapes import batch_dims, pad_packed_batch, plan_padded_shapes, shared_prompt_flags


def test_load_token_pairs_interleaves_chosen_and_rejected(tmp_path):
    rows = random_rows(5, seed=1, margins=True)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    assert pairs.pair_ids == [r["pair_id"] for r in rows]
    assert pairs.token_hashes == [r["token_hash"] for r in rows]
    for i, r in enumerate(rows):
        assert pairs.seq_ids[2 * i].tolist() == r["chosen_ids"]
        assert pairs.seq_ids[2 * i + 1].tolist() == r["rejected_ids"]
        assert pairs.seq_prompt_lens[2 * i] == r["chosen_prompt_len"]
    np.testing.assert_allclose(pairs.margins, [r["margin"] for r in rows])


@pytest.mark.parametrize("bad, reason", [
    (dict(chosen_pl=0), "prompt_len 0"),
    (dict(chosen_pl=3), "prompt_len 3 leaves no scoreable completion"),
    (dict(rejected=[5, 7, 500]), "token id out of range"),
])
def test_load_token_pairs_refuses_bad_rows_naming_them(tmp_path, bad, reason):
    rows = random_rows(3, seed=2)
    # A row as tokenize would write it (its token_hash its own): the per-row checks, not the hash, refuse it.
    rows[1] = token_row(**{"pair_id": "bad", "chosen": [5, 6, 7], "chosen_pl": 2, "rejected": [5, 6, 9],
                           "rejected_pl": 2, **bad})
    path = write_token_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(TokenDataError, match=f"row 1 \\(pair bad\\).*{reason}"):
        load_token_pairs(path, vocab_size=128)


def test_load_token_pairs_refuses_duplicate_ids_and_missing_columns(tmp_path):
    rows = random_rows(3, seed=3)
    rows[2]["pair_id"] = rows[0]["pair_id"]
    with pytest.raises(TokenDataError, match="row 2: pair_id .* repeats row 0"):
        load_token_pairs(write_token_parquet(tmp_path / "dup.parquet", rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"pair_id": ["a"]}), tmp_path / "cols.parquet")
    with pytest.raises(TokenDataError, match="missing columns"):
        load_token_pairs(tmp_path / "cols.parquet")


def test_pack_micro_batches_respects_budget_and_keeps_every_pair_once():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 60, 200)
    tokens[7] = 500   # longer than the budget on its own: isolated, never dropped
    for sort in (True, False):
        mbs = pack_micro_batches(list(range(200)), tokens, budget=128, sort=sort)
        assert sorted(i for mb in mbs for i in mb) == list(range(200))
        for mb in mbs:
            assert tokens[mb].sum() <= 128 or mb == [7]
    sequential = pack_micro_batches(list(range(200)), tokens, budget=128, sort=False)
    assert [i for mb in sequential for i in mb] == list(range(200))   # order preserved
    dense = pack_micro_batches(list(range(200)), tokens, budget=128, sort=True)
    assert len(dense) <= len(sequential)


def test_assign_pairs_to_ranks_balances_tokens():
    rng = np.random.default_rng(1)
    tokens = rng.integers(10, 400, 64)
    per_rank = assign_pairs_to_ranks(list(range(64)), tokens, 4)
    loads = [tokens[r].sum() for r in per_rank]
    assert sorted(i for r in per_rank for i in r) == list(range(64))
    assert max(loads) - min(loads) <= tokens.max()   # LPT bound


def test_plan_training_is_world_size_independent_per_step_and_covers_epochs():
    rng = np.random.default_rng(2)
    tokens = rng.integers(10, 100, 50)
    kw = dict(global_batch_pairs=8, micro_batch_tokens=200, seed=11)
    one = plan_training(tokens, epochs=2, world_size=1, **kw)
    two = plan_training(tokens, epochs=2, world_size=2, **kw)
    assert len(one) == len(two) == 2 * 7     # ceil(50 / 8) steps per epoch, last one partial
    for a, b in zip(one, two):
        flat_a = sorted(i for mb in a.rank_micro_batches[0] for i in mb)
        flat_b = sorted(i for r in b.rank_micro_batches for mb in r for i in mb)
        assert flat_a == flat_b and a.epoch == b.epoch
    for epoch in (0, 1):
        seen = [i for s in one if s.epoch == epoch for mb in s.rank_micro_batches[0] for i in mb]
        assert sorted(seen) == list(range(50))
    assert sum(map(len, one[6].rank_micro_batches[0])) == 2 and one[-1].epoch_progress == pytest.approx(2.0)
    assert plan_training(tokens, epochs=1, world_size=1, **{**kw, "seed": 12})[0] != one[0]
    half = plan_training(tokens, epochs=1.5, world_size=1, **kw)
    assert sum(len(mb) for s in half for mb in s.rank_micro_batches[0]) == 75 and half[-1].epoch_progress == pytest.approx(1.5)


def test_plan_inference_micro_batches_do_not_depend_on_world_size():
    tokens = np.random.default_rng(3).integers(10, 100, 37)
    one = plan_inference(tokens, micro_batch_tokens=150, world_size=1)[0]
    three = plan_inference(tokens, micro_batch_tokens=150, world_size=3)
    assert sorted(map(tuple, one)) == sorted(tuple(mb) for r in three for mb in r)


def test_packed_batch_positions_boundaries_and_targets(tmp_path):
    rows = [token_row("a", [10, 11, 12, 13], 2, [10, 11, 14], 2), token_row("b", [20, 21, 22], 1, [20, 23, 24, 25], 1)]
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    b = build_packed_batch(pairs, [1, 0])    # packed in reverse order: pair b first
    assert b.input_ids.tolist() == [[20, 21, 22, 20, 23, 24, 25, 10, 11, 12, 13, 10, 11, 14]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    assert b.cu_seqlens.tolist() == [0, 3, 7, 11, 14] and b.max_seqlen == 4
    # completion tokens: b.chosen [21, 22], b.rejected [23, 24, 25], a.chosen [12, 13], a.rejected [14]
    assert b.logp_targets.tolist() == [21, 22, 23, 24, 25, 12, 13, 14]
    assert (b.input_ids[0, b.logp_positions + 1] == b.logp_targets).all()
    assert b.logp_seq.tolist() == [0, 0, 1, 1, 1, 2, 2, 3]
    assert b.last_positions.tolist() == [2, 6, 10, 13]
    assert b.pair_index.tolist() == [1, 0]
    assert sum(b.seq_lens) == 14 and b.pair_index.numel() == 2
    filler = build_packed_batch(pairs, [0], weight=0.0)
    assert filler.pair_weight.tolist() == [0.0]
    assert torch.equal(b.to(torch.device("cpu")).input_ids, b.input_ids)


def test_shared_prompt_layout_gathers_prompt_keys_for_the_rejected_completion(tmp_path):
    # pair a shares prompt [10, 11]; pair c's branches start differently, so it is laid out unshared
    rows = [token_row("a", [10, 11, 12, 13], 2, [10, 11, 14], 2), token_row("c", [30, 31, 32], 1, [39, 33], 1)]
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    b = build_packed_batch(pairs, [0, 1], share_prompt=True)
    # a: [prompt 10 11 | chosen 12 13 | rejected 14], then c unshared: chosen, rejected
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 30, 31, 32, 39, 33]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 0, 1]]   # rejected restarts after the prompt
    assert b.cu_seqlens.tolist() == [0, 4, 5, 8, 10] and b.max_seqlen == 4
    # keys: a.chosen = its own 4 tokens; a.rejected = prompt (0, 1) + itself (4); c as is
    assert b.kv_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9]
    assert b.cu_seqlens_k.tolist() == [0, 4, 7, 10, 12] and b.max_seqlen_k == 4
    # a.rejected's first completion token (14) is predicted by the last prompt token (position 1)
    assert b.logp_positions.tolist() == [1, 2, 1, 5, 6, 8]
    assert b.logp_targets.tolist() == [12, 13, 14, 31, 32, 33]
    assert b.logp_seq.tolist() == [0, 0, 1, 2, 2, 3]
    assert b.last_positions.tolist() == [3, 4, 7, 9]
    assert (sum(b.seq_lens), b.computed_tokens, b.seq_lens) == (12, 10, [4, 3, 3, 2])
    unshared = build_packed_batch(pairs, [0, 1], share_prompt=False)
    assert unshared.kv_index is None and unshared.cu_seqlens_k is None and unshared.computed_tokens == 12
    nothing_shared = build_packed_batch(pairs, [1], share_prompt=True)
    assert nothing_shared.kv_index is None and nothing_shared.input_ids.tolist() == [[30, 31, 32, 39, 33]]


@pytest.mark.parametrize("share_prompt", [False, True])
def test_batch_dims_predict_the_built_batch(tmp_path, share_prompt):
    rows = random_rows(12, seed=11)
    rows.append(token_row("differs", [5, 6, 7, 8], 2, [9, 6, 7], 2))      # prompts differ: laid out unshared
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    flags = shared_prompt_flags(pairs, share_prompt)
    assert flags.sum() == (12 if share_prompt else 0)
    for mb in ([0], [12], [3, 12, 5], list(range(13)), [12, 1]):
        assert batch_dims(pairs, mb, flags) == build_packed_batch(pairs, mb, share_prompt=share_prompt).dims(), mb


def test_padded_shape_plan_covers_every_batch_and_is_deterministic():
    rng = np.random.default_rng(3)
    dims = []
    for _ in range(200):
        t = int(rng.integers(100, 3000))
        dims.append(BatchDims(tokens=t, keys=t + int(rng.integers(0, t // 2)), logp_tokens=int(t * rng.uniform(.2, .6)),
                              pairs=int(rng.integers(1, 9)), max_q=int(rng.integers(50, 400)),
                              max_k=int(rng.integers(400, 800))))
    shapes, shape_of = plan_padded_shapes(dims, 6, logp_weight=0.4)
    assert 1 < len(shapes) <= 6 and len(shape_of) == len(dims)
    assert all(shapes[a].fits(d) for d, a in zip(dims, shape_of))
    assert (shapes, shape_of) == plan_padded_shapes(dims, 6, logp_weight=0.4)
    padded = sum(shapes[a].tokens for a in shape_of)
    real = sum(d.tokens for d in dims)
    assert padded < 1.25 * real                  # 6 shapes over uniform lengths: a few % of padding each
    one, one_of = plan_padded_shapes(dims, 1, logp_weight=0.4)
    assert len(one) == 1 and one[0].tokens == max(d.tokens for d in dims) and set(one_of) == {0}
    # identical batches need one shape, padded by nothing but the trash pair
    same, _ = plan_padded_shapes([dims[0]] * 50, 8, logp_weight=0.4)
    assert len(same) == 1 and same[0].tokens == dims[0].tokens and same[0].pairs == dims[0].pairs + 1


def test_a_large_models_cheap_captures_buy_more_shapes_and_less_padding():
    """capture_cost_batches: 4 micro-batches at the 0.5B shape (and below: small models plan as before), about one
    at 7B's parameters a layer (both measured); the same run then gets more shapes and less padding."""
    from stages.engine.padded_shapes import CAPTURE_COST_BATCHES, capture_cost_batches
    assert capture_cost_batches(494_032_768, 24) == CAPTURE_COST_BATCHES == 4.0
    assert capture_cost_batches(1_000_000, 2) == 4.0 and capture_cost_batches(10, 0) == 4.0
    assert 0.9 < capture_cost_batches(7_615_616_512, 28) < 1.1
    rng = np.random.default_rng(5)
    dims = []
    for _ in range(64):
        t = int(rng.integers(200, 3000))
        dims.append(BatchDims(tokens=t, keys=t, logp_tokens=t // 2, pairs=8, max_q=400, max_k=400))
    small, small_of = plan_padded_shapes(dims, 8, 0.08, capture_cost_batches(494_032_768, 24))
    large, large_of = plan_padded_shapes(dims, 8, 0.08, capture_cost_batches(7_615_616_512, 28))
    assert len(large) > len(small)
    assert sum(large[a].tokens for a in large_of) < sum(small[a].tokens for a in small_of)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_padding_keeps_every_real_token_boundary_and_target(tmp_path, share_prompt):
    rows = random_rows(8, seed=12)
    rows.append(token_row("differs", [5, 6, 7, 8], 2, [9, 6, 7], 2))
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    b = build_packed_batch(pairs, [8, 2, 5], share_prompt=share_prompt)
    d = b.dims()
    extra_keys = 7 if share_prompt else 0
    shape = BatchDims(tokens=d.tokens + 5, keys=d.keys + 5 + extra_keys, logp_tokens=d.logp_tokens + 4,
                      pairs=d.pairs + 3, max_q=d.max_q + 1, max_k=max(d.max_k, 7) + 1)
    p = pad_packed_batch(b, shape)
    assert p.dims() == shape
    t, s = d.tokens, 2 * d.pairs
    assert torch.equal(p.input_ids[0, :t], b.input_ids[0]) and torch.equal(p.position_ids[0, :t], b.position_ids[0])
    assert torch.equal(p.position_ids[0, t:], torch.arange(5))
    assert torch.equal(p.cu_seqlens[:s + 1], b.cu_seqlens)
    q_lens = p.cu_seqlens.diff().tolist()
    assert q_lens[s:] == [5, 0, 0, 0, 0, 0]                # the trash pair's chosen = the pad tokens, rest empty
    assert torch.equal(p.pair_weight, torch.tensor([1.0] * 3 + [0.0] * 3))
    assert torch.equal(p.logp_seq[d.logp_tokens:], torch.full((4,), s))
    for name in ("logp_positions", "logp_targets", "logp_seq", "last_positions", "pair_index"):
        got, want = getattr(p, name), getattr(b, name)
        assert torch.equal(got[:want.shape[0]], want), name
    if share_prompt:
        assert torch.equal(p.kv_index[:d.keys], b.kv_index)
        assert torch.equal(p.kv_index[d.keys:d.keys + 5], torch.arange(t, t + 5))   # pad queries see themselves
        assert p.cu_seqlens_k.diff().tolist()[s:] == [5, 7, 0, 0, 0, 0]
    else:
        assert p.kv_index is None and p.cu_seqlens_k is None
    # an unshared batch padded to a shape with spare keys gets an identity kv_index
    if share_prompt:
        lone = build_packed_batch(pairs, [8], share_prompt=True)
        assert lone.kv_index is None
        q = pad_packed_batch(lone, BatchDims(tokens=lone.computed_tokens + 2, keys=lone.computed_tokens + 4,
                                             logp_tokens=int(lone.logp_positions.shape[0]), pairs=2, max_q=8, max_k=8))
        assert torch.equal(q.kv_index[:lone.computed_tokens], torch.arange(lone.computed_tokens))
    with pytest.raises(ValueError, match="does not fit"):
        pad_packed_batch(b, BatchDims(tokens=d.tokens, keys=d.keys, logp_tokens=d.logp_tokens, pairs=d.pairs,
                                      max_q=d.max_q, max_k=d.max_k))      # no room for the trash pair
