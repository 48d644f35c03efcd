"""Batch ordering (self first, then cross by source) and mini-batch schedule across epochs."""

import torch

from hacrl_fed.algorithm import minibatch_schedule, order_rows


def test_order_self_first_then_cross_by_source_stable():
    is_self = torch.tensor([False, True, False, True, False, False])
    src = torch.tensor([2, 0, 1, 0, 2, 1])
    perm = order_rows(is_self, src)
    assert perm.tolist() == [1, 3, 2, 5, 0, 4]


def test_order_matches_loop_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 50, (1,), generator=g))
        src = torch.randint(0, 4, (n,), generator=g)
        is_self = src == 1
        want = [i for i in range(n) if is_self[i]]
        for j in range(4):
            want += [i for i in range(n) if not is_self[i] and src[i] == j]
        assert order_rows(is_self, src).tolist() == want


def test_schedule_counts_across_epochs():
    sched = minibatch_schedule(10, 4, epochs=2)
    assert [m for m, _ in sched] == [0, 1, 2, 3, 4, 5]
    assert [idx.tolist() for _, idx in sched[:3]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sched[3][1].tolist() == [0, 1, 2, 3]
    assert minibatch_schedule(0, 4) == []


def test_paper_schedule_four_steps_hacpo_two_gspo():
    # B=128 prompts, G=8, mini-batch of 64 prompts = 512 sequences
    assert len(minibatch_schedule(2 * 128 * 8, 512)) == 4
    assert len(minibatch_schedule(128 * 8, 512)) == 2
