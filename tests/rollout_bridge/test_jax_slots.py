"""The JAX engine's slot table: which rows and attention windows a decode call runs."""

from rollout_bridge.jax_slots import KeptTurns, SlotTable, attention_windows, num_groups, row_buckets

WINDOWS = (16, 32, 64, 128)  # any ascending list; the engine uses attention_windows


def fill(table, slot, length):
    table.fill(slot, list(range(3, 3 + length + 1)), 0, 100, 1.0, 0, 1.0, seed=slot, stop_ids=())


def test_attention_windows():
    assert attention_windows(64, 1024) == (64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert attention_windows(16, 128) == (16, 24, 32, 48, 64, 96, 128)
    assert attention_windows(64, 448)[-2:] == (384, 448)
    assert attention_windows(128, 128) == (128,)


def test_row_buckets_step_by_at_most_half_and_split_into_groups_of_four():
    for max_slots in (8, 12, 64, 128, 200, 256):
        buckets = row_buckets(max_slots)
        assert buckets[0] == 8 and buckets[-1] == max_slots
        assert all(b / a <= 1.5 for a, b in zip(buckets, buckets[1:]))
        assert all(b % 4 == 0 for b in buckets[:-1])
    assert row_buckets(5) == [5] and row_buckets(1) == [1]


def test_num_groups():
    assert [num_groups(n) for n in (64, 8, 4, 6, 3, 1)] == [16, 2, 1, 3, 3, 1]


def test_plan_runs_active_slots_longest_first_in_a_bucket():
    table = SlotTable(32, 4, WINDOWS, select_rows=True)
    assert table.buckets == [8, 12, 16, 24, 32]
    for slot, length in [(3, 10), (7, 100), (12, 40), (20, 5), (21, 90)]:
        fill(table, slot, length)
    plan = table.plan(num_steps=8)
    # 5 active slots: a bucket of 8 rows, the longest first, then free slots as padding.
    assert plan.rows_b.tolist()[:5] == [7, 21, 12, 3, 20]
    assert len(plan.rows_b) == 8 and len(set(plan.rows_b.tolist())) == 8
    assert not table.arrays["active_b"][plan.rows_b[5:]].any()
    # Two groups of four rows, windows by each group's longest reach (length + 8 steps): 108 needs 128,
    # 13 fits in 16.
    assert [WINDOWS[w] for w in plan.window_g] == [128, 16]
    state = table.state(plan)
    assert state.lengths_b.tolist()[:5] == [100, 90, 40, 10, 5]
    # The call's state goes back to the slots it came from.
    table.update(plan, state._replace(lengths_b=state.lengths_b + 1))
    assert table.arrays["lengths_b"][[3, 7, 12, 20, 21]].tolist() == [11, 101, 41, 6, 91]
    for slot in range(22, 31):  # 14 active: the next bucket
        fill(table, slot, 1)
    assert len(table.plan(8).rows_b) == 16


def test_slot_sharded_table_runs_every_slot():
    table = SlotTable(4, 4, WINDOWS, select_rows=False)
    fill(table, 2, 20)
    plan = table.plan(num_steps=8)
    assert plan.rows_b is None and [WINDOWS[w] for w in plan.window_g] == [32]
    assert table.slots(plan).tolist() == [0, 1, 2, 3]
    assert [(p.rows_b, len(p.window_g)) for p in table.idle_plans()] == [(None, 1)]


def test_kept_turns_give_back_a_slot_only_to_a_sequence_that_extends_it():
    kept = KeptTurns()
    kept.keep("a", 3, [5, 6, 7], length=3)
    kept.keep("b", 4, [5, 6], length=3)  # the slot holds another length: not kept
    assert 3 in kept and 4 not in kept
    assert kept.take("a", [5, 6, 7, 8, 9]) == (3, 3) and 3 not in kept
    kept.keep("a", 3, [5, 6, 7], length=3)
    assert kept.take("a", [5, 6, 7]) == (3, 0)  # nothing new to feed: computed from scratch
    kept.keep("a", 3, [5, 6, 7], length=3)
    assert kept.take("a", [5, 9, 7, 8]) == (3, 0)  # not an extension
    assert kept.take("z", [1, 2]) == (None, 0)
    kept.keep("a", 1, [1], length=1)
    kept.keep("c", 2, [2], length=1)
    assert kept.evict() == 1 and kept.evict() == 2 and 1 not in kept
