"""How a model call is split over the pool's ranks (``ltx_mgpu.denoise.parallel.layout.call_layout``):
the rules, and the property the module's cost argument rests on: where ``auto`` splits a batch,
every rank holds the tokens it would under Ulysses over the whole pool, in smaller groups.
Equality with world size 1 on real ranks: tests/integration/test_cfg_parallel.py."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ltx_mgpu.denoise.parallel.layout import CallLayout, call_layout


@pytest.mark.parametrize(("layout", "batch", "world", "samples", "ranks"), [
    ("auto", 2, 2, (1, 1), 1), ("auto", 2, 4, (1, 1), 2), ("auto", 2, 8, (1, 1), 4),  # cond + uncond on halves
    ("auto", 3, 3, (1, 1, 1), 1), ("auto", 3, 6, (1, 1, 1), 2),  # CFG + a perturbed pass / DualCFGGuider
    ("auto", 3, 2, (3,), 2), ("auto", 3, 4, (3,), 4), ("auto", 3, 8, (3,), 8),  # odd batch, even pool: Ulysses
    ("auto", 4, 4, (1, 1, 1, 1), 1), ("auto", 4, 8, (1, 1, 1, 1), 2), ("auto", 6, 4, (3, 3), 2),
    ("auto", 1, 8, (1,), 8), ("auto", 5, 1, (5,), 1),
    ("ulysses", 2, 2, (2,), 2), ("ulysses", 4, 4, (4,), 4),
    ("cfg_ulysses", 2, 4, (1, 1), 2), ("cfg_ulysses", 4, 4, (2, 2), 2), ("cfg_ulysses", 3, 2, (2, 1), 1),
    ("cfg_ulysses", 3, 8, (2, 1), 4), ("cfg_ulysses", 1, 4, (1,), 4), ("cfg_ulysses", 3, 3, (1, 1, 1), 1),
])
def test_the_rules(layout, batch, world, samples, ranks):
    got = call_layout(layout, batch, world)
    assert got == CallLayout(samples, ranks)
    assert sum(got.samples) == batch and got.groups * got.ranks_per_group == world
    assert [got.part(i) for i in range(got.groups)] == \
        [slice(sum(samples[:i]), sum(samples[:i + 1])) for i in range(len(samples))]


def test_auto_never_gives_a_rank_more_tokens_than_ulysses_and_splits_whenever_that_holds():
    for world in range(1, 9):
        for batch in range(1, 13):
            got = call_layout("auto", batch, world)
            per_rank = Fraction(max(got.samples), got.ranks_per_group)  # samples' tokens on the busiest rank
            assert per_rank == Fraction(batch, world), (batch, world)  # Ulysses's B T / W
            # the most groups for which that holds: a group count dividing both
            assert got.groups == max(g for g in range(1, world + 1) if batch % g == 0 and world % g == 0)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="layout must be one of 'auto', 'ulysses' or 'cfg_ulysses', got 'halves'"):
        call_layout("halves", 2, 2)
    with pytest.raises(ValueError, match="at least 1, got 0 and 2"):
        call_layout("auto", 0, 2)
