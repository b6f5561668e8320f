"""How a ragged step is split into attention groups (padding vs number of groups)."""
import pytest

from specserve.model.attention import GROUP_OVERHEAD_BLOCKS, AttentionMetadata, _split_by_context


@pytest.mark.parametrize("blocks, want", [
    ([3], [[0]]),
    ([3, 3, 4, 4], [[0, 1, 2, 3]]),                        # a little padding beats another group
    ([2, 40, 3, 41], [[0, 2], [1, 3]]),                    # short and long contexts apart, batch order kept
    ([5] * 20 + [6], [list(range(21))]),                   # 20 x 1 block of padding <= the overhead
    ([5] * 20 + [7], [list(range(20)), [20]]),             # 20 x 2 blocks > the overhead
])
def test_split_by_context(blocks, want):
    assert _split_by_context(list(range(len(blocks))), blocks) == want


def test_no_group_pads_more_than_the_overhead_of_another():
    blocks = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89] * 3
    for group in _split_by_context(list(range(len(blocks))), blocks):
        sizes = sorted(blocks[i] for i in group)
        for j in range(1, len(sizes)):
            assert j * (sizes[j] - sizes[j - 1]) <= GROUP_OVERHEAD_BLOCKS


def test_metadata_groups_decodes_by_context_and_keeps_prefill_apart():
    # block size 4: decodes with 8, 200 and 9 cached tokens, a 30-token prefill chunk.
    q_lens, ctx_lens = [1, 1, 1, 30], [8, 200, 9, 30]
    tables = [list(range(i * 60, i * 60 + (c + 3) // 4)) for i, c in enumerate(ctx_lens)]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 4)
    members = [g.token_index.tolist() for g in meta.groups]
    assert members == [[0, 2], [1], list(range(3, 33))]
    assert not any(g.is_whole_batch for g in meta.groups)
    whole = AttentionMetadata.build([1, 1], [8, 9], tables[:1] + tables[2:3], 4)
    assert len(whole.groups) == 1 and whole.groups[0].is_whole_batch
