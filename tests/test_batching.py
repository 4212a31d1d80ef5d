import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slimroute.engine.batching import PaddingStats, pad_right, plan_batches


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


def plan_cost(lengths, batches, overhead):
    return sum(overhead + len(b) * max(lengths[i] for i in b) for b in batches)


def cheapest_by_brute_force(lengths, batch_size, budget, max_padding, overhead):
    """Every split of the sorted items into consecutive batches within the limits; the cheapest cost."""
    sizes = sorted(lengths)
    best = None
    for cuts in itertools.product([False, True], repeat=len(sizes) - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [len(sizes)]
        groups = [sizes[a:b] for a, b in itertools.pairwise(bounds)]
        ok = all(len(g) == 1 or (len(g) <= batch_size and (budget is None or len(g) * g[-1] <= budget)
                                 and (max_padding is None or len(g) * g[-1] - sum(g) <= max_padding * len(g) * g[-1]))
                 for g in groups)
        if ok:
            cost = sum(overhead + len(g) * g[-1] for g in groups)
            best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=9),
    batch_size=st.integers(1, 9),
    budget=st.one_of(st.none(), st.integers(1, 1500)),
    max_padding=st.one_of(st.none(), st.floats(0, 0.5)),
    overhead=st.integers(0, 200),
)
def test_sorted_plan_is_the_cheapest_split(lengths, batch_size, budget, max_padding, overhead):
    batches = plan_batches(lengths, batch_size, budget, True, max_padding, overhead)
    assert plan_cost(lengths, batches, overhead) == cheapest_by_brute_force(lengths, batch_size, budget,
                                                                             max_padding, overhead)


def test_the_sparse_tail_goes_alone_and_the_dense_body_fills_batches():
    lengths = [20] * 64 + [150, 300, 450]
    assert [len(b) for b in plan_batches(lengths, 32)] == [32, 32, 1, 1, 1]
    # a pass that costs more than padding the tail: one batch for the three
    assert [len(b) for b in plan_batches(lengths, 32, batch_overhead_tokens=1000)] == [32, 32, 3]
    # a pass that costs nothing: no padding at all
    stats = PaddingStats()
    for b in plan_batches([3, 9, 3, 4, 9], 32, batch_overhead_tokens=0):
        stats.add([[3, 9, 3, 4, 9][i] for i in b])
    assert stats.padded_tokens == 0


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
