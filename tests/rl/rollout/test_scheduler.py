"""``Scheduler``'s guarantees, driven step by step without a model: the token budget and chunked
prefill with decodes first, the ``max_num_seqs`` cap, prefix-cache hits by chained hash (and
only under the same weights), shared prefill of a group's common prompt, sessions adopted by the
next turn, and how memory is reclaimed: idle sessions least recently used first (and after their
TTL), then the newest running sequence, preempted by recompute."""

import dataclasses

from jointrl.rl.rollout.block_manager import BlockManager
from jointrl.rl.rollout.scheduler import Scheduler
from jointrl.rl.rollout.sequence import Sequence, Status

BS = 4  # block size
SAMPLED = 7  # the token each simulated decode appends


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence as the scheduler sees it: ids, tokens, cache bookkeeping. The sampling fields
    (params, generator, output record) are the engine's, never read by the scheduler: None."""
    required = {f.name: None for f in dataclasses.fields(Sequence)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return Sequence(**required | {"seq_id": seq_id, "token_ids": list(tokens)})


def scheduler(num_blocks: int = 16, max_num_seqs: int = 8, max_tokens: int = 64, ttl: float = 0.0,
              prefix_cache: bool = True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, max_tokens, ttl, prefix_cache)


def step(s: Scheduler, now: float = 0.0) -> list[tuple[Sequence, int]]:
    """One engine step (``LLMEngine.step``): schedule, compute the scheduled tokens, register the
    newly full blocks, and append a sampled token to every sequence that reached its end."""
    batch = s.schedule(now)
    for sq, n in batch:
        assert len(sq.block_table) >= s.bm.blocks_for(sq.num_computed + n)  # room for what it computes
        sq.num_computed += n
        s.register_computed(sq)
    for sq, _ in batch:
        if sq.num_computed == len(sq):
            sq.token_ids.append(SAMPLED)
    return batch


def ids(batch: list[tuple[Sequence, int]]) -> list[tuple[int, int]]:
    return [(sq.seq_id, n) for sq, n in batch]


def test_a_long_prompt_is_prefilled_in_chunks_and_decodes_go_first():
    s = scheduler(max_tokens=8)
    a = seq(0, range(100, 110))
    s.add(a)
    assert ids(step(s)) == [(0, 8)]  # chunked: the budget, not the prompt, bounds a step
    b = seq(1, range(200, 220))
    s.add(b)
    assert ids(step(s)) == [(0, 2), (1, 6)]  # a's rest of its prompt, b's first chunk in what is left
    assert ids(step(s)) == [(0, 1), (1, 7)]  # a decodes (first), b takes the rest of the budget
    assert ids(step(s)) == [(0, 1), (1, 7)]
    assert ids(step(s)) == [(0, 1), (1, 1)]  # both decode


def test_no_more_than_max_num_seqs_run_at_once():
    s = scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, [i] * 5))
    assert ids(step(s)) == [(0, 5), (1, 5)]
    assert [q.seq_id for q in s.waiting] == [2] and s.waiting[0].status is Status.WAITING
    s.finish(s.running[0], now=0.0)
    assert ids(step(s)) == [(1, 1), (2, 5)]


def test_a_prompt_shares_the_cached_blocks_of_an_equal_prefix_by_chained_hash():
    s = scheduler()
    a = seq(0, list(range(1, 10)))  # blocks [1..4] [5..8], then 9
    s.add(a)
    step(s)
    held = a.block_table[:2]
    s.finish(a, now=0.0)  # ttl 0: no session, the blocks go to the free list but stay cached
    assert s.bm.num_free == 16

    same_prefix = seq(1, list(range(1, 9)) + [50, 51])
    s.add(same_prefix)
    assert ids(step(s)) == [(1, 2)]  # only the tokens after the two shared blocks are computed
    assert same_prefix.block_table[:2] == held and same_prefix.num_computed == 10

    first_block_only = seq(2, list(range(1, 5)) + [60, 61, 62, 63, 64])
    s.add(first_block_only)
    assert ids(step(s)) == [(1, 1), (2, 5)]
    assert first_block_only.block_table[0] == held[0] and first_block_only.block_table[1] != held[1]

    # block 1's tokens after another block 0: the chain differs, so nothing is shared
    other_head = seq(3, [70, 71, 72, 73] + list(range(5, 9)) + [9])
    s.add(other_head)
    batch = step(s)
    assert (3, 9) in ids(batch) and not set(other_head.block_table) & set(held)
    assert [s.bm.ref_count[b] for b in held] == [2, 1]  # a's freed blocks, shared by the two live prompts


def test_a_hit_keeps_one_token_to_compute():
    s = scheduler()
    a = seq(0, list(range(1, 9)))  # exactly two blocks
    s.add(a)
    step(s)
    s.finish(a, now=0.0)
    again = seq(1, list(range(1, 9)))
    s.add(again)
    assert ids(step(s)) == [(1, 4)]  # block 0 shared; block 1 recomputed so the step has a token to sample from


def test_new_weights_miss_the_cache_of_the_old():
    s = scheduler()
    a = seq(0, list(range(1, 10)))
    s.add(a)
    step(s)
    s.finish(a, now=0.0)
    s.version = 1  # LLMEngine.update_weights
    b = seq(1, list(range(1, 10)))
    s.add(b)
    assert ids(step(s)) == [(1, 9)]
    assert b.cache_version == 1


def test_without_the_prefix_cache_nothing_is_shared():
    s = scheduler(prefix_cache=False)
    a = seq(0, list(range(1, 10)))
    s.add(a)
    step(s)
    s.finish(a, now=0.0)
    s.add(seq(1, list(range(1, 10))))
    assert ids(step(s)) == [(1, 9)]


def test_a_group_prefills_its_common_prompt_once():
    """GRPO's members arrive together: the first computes the shared blocks, the others wait for
    them (a running sequence is computing them) and then take them from the cache."""
    s = scheduler()
    prompt = list(range(1, 10))
    group = [seq(i, prompt) for i in range(3)]
    for q in group:
        s.add(q)
    assert ids(step(s)) == [(0, 9)]
    assert [q.seq_id for q in s.waiting] == [1, 2] and not group[1].block_table
    assert ids(step(s)) == [(0, 1), (1, 1), (2, 1)]  # each member computes only the partial block
    assert group[1].block_table[:2] == group[2].block_table[:2] == group[0].block_table[:2]
    assert [s.bm.ref_count[b] for b in group[0].block_table[:2]] == [3, 3]


def test_the_next_turn_adopts_its_session_and_prefills_only_the_new_tokens():
    s = scheduler(ttl=60.0)
    turn1 = seq(0, list(range(1, 10)))
    s.add(turn1)
    step(s)  # 9 tokens in, one sampled: 10 tokens, 9 computed
    s.finish(turn1, now=1.0)
    assert turn1.status is Status.IDLE and s.idle[0] is turn1
    table = list(turn1.block_table)
    free = s.bm.num_free
    turn2 = seq(1, turn1.token_ids + [40, 41, 42])  # the next prompt extends the transcript
    s.add(turn2)
    assert not s.idle and turn1.block_table == []  # the session moved to the new turn
    assert turn2.block_table == table and turn2.num_computed == 9
    assert ids(step(s, now=2.0)) == [(1, 4)]  # the sampled token and the three new ones
    assert s.bm.num_free == free - 1  # one more block for positions 12..


def test_an_idle_session_expires_after_its_ttl():
    s = scheduler(ttl=10.0)
    a = seq(0, list(range(1, 10)))
    s.add(a)
    step(s)
    s.finish(a, now=0.0)
    assert s.bm.num_free == 16 - 3
    s.schedule(now=9.0)
    assert 0 in s.idle
    s.schedule(now=10.0)
    assert not s.idle and s.bm.num_free == 16 and s.num_evicted == 1


def test_memory_goes_first_from_idle_sessions_least_recently_used_first():
    s = scheduler(num_blocks=4, ttl=60.0)
    old, recent = seq(0, list(range(10, 18))), seq(1, list(range(20, 28)))
    for q, t in ((old, 1.0), (recent, 2.0)):
        s.add(q)
        step(s, now=t)
        s.finish(q, now=t)  # each idle session holds the 2 blocks of its 8 computed tokens
    assert s.bm.num_free == 0
    runner = seq(2, list(range(30, 35)))
    s.add(runner)
    assert ids(step(s, now=3.0)) == [(2, 5)]
    assert list(s.idle) == [1] and s.num_evicted == 1 and s.num_preempted == 0  # the older one went


def test_preemption_recomputes_the_newest_running_sequence_and_keeps_its_blocks_cached():
    s = scheduler(num_blocks=4)
    a, b = seq(0, list(range(1, 9))), seq(1, list(range(11, 19)))  # 8 tokens: 2 blocks each
    s.add(a)
    s.add(b)
    step(s)  # both prefilled, each sampled a 9th token: its decode needs a third block
    assert s.bm.num_free == 0
    b_blocks = list(b.block_table)
    assert ids(step(s)) == [(0, 1)]  # no session to evict: b, the newest, makes room for a
    assert s.num_preempted == 1 and b.status is Status.WAITING and list(s.waiting) == [b]
    # b released its table tail first, a took the tail block; b's head block was still cached, and
    # b, back at the head of the queue, took it again from the prefix cache (no recompute of it)
    assert a.block_table[2] == b_blocks[1]
    assert b.block_table == b_blocks[:1] and b.num_computed == BS
    s.finish(a, now=0.0)
    assert ids(step(s)) == [(1, 5)]  # re-admitted: block 0 from the cache (block 1 went to a), the rest recomputed


def test_preempt_all_frees_every_block_and_the_cache():
    s = scheduler(ttl=60.0)
    idle, running, waiting = seq(0, list(range(1, 10))), seq(1, list(range(11, 20))), seq(2, list(range(21, 26)))
    s.add(idle)
    step(s)
    s.finish(idle, now=0.0)
    s.add(running)
    step(s)
    s.add(waiting)
    s.preempt_all()  # new weights under the reprefill policy
    assert s.bm.num_free == 16 and not s.idle and not s.running
    assert [q.seq_id for q in s.waiting] == [1, 2] and all(not q.block_table for q in s.waiting)
    assert not any(s.bm.is_cached(hash((s.version, c))) for c in running.chain)
