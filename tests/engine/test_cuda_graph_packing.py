"""The packed layout a CUDA-graph step reads (engine/cuda_graphs.py), written on the host: runs on any machine."""
import numpy as np

from specserve.step_types import ForwardItem
from specserve.engine.cuda_graphs import pack_step, split_steps


def test_a_step_packs_tokens_positions_slots_sequences_tables_drafts_and_logit_rows():
    # a decode at position 17 (block table [5, 9]), a verify: 1 host token + 2 drafts on the device ending at
    # position 4 (table [3]), a 2-token prefill piece at positions 0-1 wanting no logits (table [7])
    items = [ForwardItem([11], 18, [5, 9], 1), ForwardItem([12], 5, [3], 3, 2), ForwardItem([13, 14], 2, [7], 0)]
    bucket, width, bs, sink = 8, 3, 16, 99 * 16
    buf = np.full(bucket * (8 + width), -1, dtype=np.int64)  # stale contents everywhere
    assert pack_step(buf, items, bucket, width, bs, sink) == (2, 2 + 4)
    t = bucket
    assert buf[:t].tolist() == [11, 12, 0, 0, 13, 14, 0, 0]                  # drafts and padding: 0
    assert buf[t:2 * t].tolist() == [17, 2, 3, 4, 0, 1, 0, 0]
    assert buf[2 * t:3 * t].tolist() == [9 * bs + 1, 3 * bs + 2, 3 * bs + 3, 3 * bs + 4, 7 * bs, 7 * bs + 1,
                                         sink, sink]
    seqs = buf[3 * t:6 * t].reshape(3, t)
    assert seqs[:, :3].T.tolist() == [[0, 1, 18], [1, 3, 5], [4, 2, 2]] and not seqs[:, 3:].any()
    tables = buf[6 * t:6 * t + t * width].reshape(t, width)
    assert tables[:3].tolist() == [[5, 9, 0], [3, 0, 0], [7, 0, 0]]
    base = 6 * t + t * width
    assert buf[base:base + 6].tolist() == [2, 3, 0, 1, 2, 3]  # draft slots, then the logit rows


def test_a_smaller_step_after_a_larger_one_leaves_nothing_stale_that_it_reads():
    bucket, width, bs, sink = 4, 2, 16, 50 * 16
    buf = np.zeros(32 * (8 + width), dtype=np.int64)
    big = [ForwardItem([1], 20 + i, [i, i + 1], 1) for i in range(4)]
    pack_step(buf, big, bucket, width, bs, sink)
    assert pack_step(buf, [ForwardItem([7], 3, [4], 1)], bucket, width, bs, sink) == (0, 1)
    assert buf[:bucket].tolist() == [7, 0, 0, 0]
    assert buf[2 * bucket:3 * bucket].tolist() == [4 * bs + 2, sink, sink, sink]
    assert not buf[3 * bucket:6 * bucket].reshape(3, bucket)[:, 1:].any()  # no sequence left over


def test_long_items_become_pieces_and_steps_stay_within_the_largest_bucket():
    # a 70-token prefill chunk of positions 30-99 wanting its last logit, a verify with 2 device drafts, a
    # 40-token prompt-logprobs chunk (every row's logits) of positions 0-39
    items = [ForwardItem(list(range(70)), 100, [1, 2, 3, 4, 5, 6, 7], 1), ForwardItem([5], 9, [8], 3, 2),
             ForwardItem(list(range(100, 140)), 40, [9, 10, 11], 40)]
    steps = split_steps(items, 64)
    pieces = [(len(p.token_ids), p.ctx_len, p.num_logits, p.num_device_tokens) for s in steps for p in s]
    assert pieces == [(32, 62, 0, 0), (32, 94, 0, 0), (6, 100, 1, 0), (1, 9, 3, 2), (32, 32, 32, 0),
                      (8, 40, 8, 0)]
    assert [sum(p.num_tokens for p in s) for s in steps] == [64, 49]  # in order, none past 64 tokens
    assert [p.token_ids for s in steps for p in s][2] == list(range(64, 70))
    assert all(p.block_table is items[0].block_table for p in steps[0])
    # the logit rows, concatenated over the pieces, are the items' own: 1 + 3 + 40
    assert sum(p.num_logits for s in steps for p in s) == 44


def test_a_step_that_fits_is_one_sub_step_of_its_own_items():
    items = [ForwardItem([1], 10, [0], 1), ForwardItem([2, 3], 5, [1], 1)]
    assert split_steps(items, 512) == [items]
