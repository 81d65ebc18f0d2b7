from core.kv.reuse import find_run

SYSTEM, TASK_A, TASK_B, NOTE = list(range(100)), [500 + i for i in range(7)], [600 + i for i in range(12)], \
    [1000 + i for i in range(300)]


def dense(tokens):
    return list(range(len(tokens)))


def test_a_block_after_a_longer_task_is_found_where_both_prompts_hold_it():
    donor = SYSTEM + TASK_A + NOTE + [7, 8, 9]
    prompt = SYSTEM + TASK_B + NOTE + [3]
    assert find_run(prompt, len(SYSTEM), donor, dense(donor), 256, 64) == (112, 107, 300)


def test_a_dropped_or_compacted_donor_token_ends_the_run():
    donor = SYSTEM + TASK_A + NOTE
    pos = dense(donor)
    pos[107 + 200] = -1  # dropped by a sparse prefill
    assert find_run(SYSTEM + TASK_B + NOTE, 100, donor, pos, 256, 64) is None
    assert find_run(SYSTEM + TASK_B + NOTE, 100, donor, pos, 128, 64) == (112, 107, 200)


def test_nothing_short_far_or_before_the_start():
    donor = SYSTEM + TASK_A + NOTE
    assert find_run(SYSTEM + TASK_B + NOTE, 100, donor, dense(donor), 400, 64) is None  # too short a run
    assert find_run(SYSTEM + list(range(5000, 5100)) + NOTE, 100, donor, dense(donor), 256, 64) is None  # too far
    # the donor's copy must lie past the shared prefix: a prompt repeating its own system prompt finds nothing
    assert find_run(SYSTEM + TASK_B + SYSTEM * 3, 100, donor, dense(donor), 32, 64) is None
