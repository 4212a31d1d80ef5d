import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slimroute.batching import PaddingStats, pad_right, plan_batches


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 500), max_size=200),
    batch_size=st.integers(1, 64),
    budget=st.one_of(st.none(), st.integers(1, 4000)),
    sort=st.booleans(),
    max_padding=st.one_of(st.none(), st.floats(0, 0.5)),
)
def test_every_item_once_within_limits(lengths, batch_size, budget, sort, max_padding):
    batches = plan_batches(lengths, batch_size, budget, sort, max_padding)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert 1 <= len(b) <= batch_size
        padded = max(lengths[i] for i in b) * len(b)
        if budget is not None and len(b) > 1:
            assert padded <= budget
        if max_padding is not None:
            assert padded - sum(lengths[i] for i in b) <= max_padding * padded + 1e-9
    if sort:
        assert [lengths[i] for i in flat] == sorted(lengths)
    else:
        assert flat == list(range(len(lengths)))


def test_sorting_cuts_padding():
    lengths = [5, 500, 6, 480, 7, 470, 8, 460] * 8
    stats = {}
    for sort in (False, True):
        s = PaddingStats()
        for b in plan_batches(lengths, 8, sort=sort):
            s.add([lengths[i] for i in b])
        stats[sort] = s.overhead
    assert stats[True] < 0.05 < stats[False]


def test_max_padding_splits_the_sparse_tail():
    lengths = [20] * 64 + [150, 300, 450]
    batches = plan_batches(lengths, 32, max_padding=0.05)
    assert [len(b) for b in batches] == [32, 32, 1, 1, 1]
    assert [len(b) for b in plan_batches(lengths, 32)] == [32, 32, 3]


def test_pad_right():
    ids, mask, lengths = pad_right([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.equal(lengths, torch.tensor([3, 1]))


def test_padding_overhead_is_padded_over_processed():
    s = PaddingStats()
    s.add([2, 4])
    assert (s.real_tokens, s.processed_tokens, s.padded_tokens) == (6, 8, 2)
    assert s.overhead == 0.25
