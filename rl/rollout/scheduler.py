"""``Scheduler``: which sequences run in the next step, and with how many tokens each.

Every step runs one forward over a flat batch: each running sequence that is ready to
decode contributes 1 token, sequences still prefilling contribute a chunk, all within
``max_num_batched_tokens`` (chunked prefill: a long prompt never stalls the decodes).
Requests join between steps and leave when their turn ends (continuous batching).

Memory, in the order it is reclaimed when a step needs a block and none is free:
1. idle sessions, least recently used first (also dropped after ``session_ttl_s``);
2. preemption by recompute: the newest running sequence drops its blocks and goes back to
   the head of the queue; its full blocks stay in the prefix cache, so re-admission reuses
   whatever was not overwritten meanwhile.
A request that could not fit even alone is rejected up front (``LLMEngine.add_request``).
Both count in ``num_dropped`` / ``dropped_tokens`` (with the queued sessions unpinned for the head
of the queue): caches released for memory, whose computed tokens run again (``LLMEngine`` warns).

Sessions. A turn that ends leaves its sequence IDLE with its blocks held. A new prompt that
starts with an idle session's tokens adopts the session (its block table and computed
length), so the next turn prefills only the new tokens. Shared prefill (fork). A waiting
request whose next full prompt block is being computed by a running sequence waits for it,
then takes the block from the prefix cache: the members of a GRPO group prefill their
common prompt once (each recomputes at most one partial block).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from jointrl.rl.rollout.block_manager import BlockManager, chain_hash
from jointrl.rl.rollout.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 session_ttl_s: float, prefix_cache: bool = True) -> None:
        self.bm = block_manager
        self.bs = block_manager.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.session_ttl_s = session_ttl_s
        self.prefix_cache = prefix_cache  # off for KDA models: their state at a block boundary is not kept
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # seq_id -> session, LRU first
        self._idle_index: dict[int, list[Sequence]] = {}  # chain hash of its last full block -> sessions
        self._inflight: set[int] = set()  # prefix keys of blocks that admitted sequences will compute
        self.version = 0  # weights version (the prefix-cache key's root)
        self.num_preempted = self.num_evicted = 0  # evicted: idle sessions dropped, for memory or past their TTL
        self.num_dropped = self.dropped_tokens = 0  # caches released for memory, and their computed tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- admission -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._extend_chain(seq, len(seq) // self.bs)
        session = self._find_session(seq)
        if session is not None:
            self._drop_idle(session)
            seq.block_table, seq.num_computed = session.block_table, session.num_computed
            seq.num_registered, seq.cache_version, seq.routed, seq.recurrent = (
                session.num_registered, session.cache_version, session.routed, session.recurrent)
            session.block_table = []
        self.waiting.append(seq)

    def _find_session(self, seq: Sequence) -> Sequence | None:
        for i in range(len(seq.chain) - 1, -1, -1):
            for s in self._idle_index.get(seq.chain[i], ()):
                if len(s) <= len(seq) and seq.token_ids[:len(s)] == s.token_ids and s.image_keys == {
                        p: k for p, k in seq.image_keys.items() if p < len(s)}:  # same screenshots too
                    return s
        return None

    # -- one step --------------------------------------------------------------------------
    def schedule(self, now: float) -> list[tuple[Sequence, int]]:
        """→ [(sequence, number of new tokens)], decodes first."""
        self._expire(now)
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        queue = deque(sorted(self.running, key=lambda s: s.num_new > 1))  # decodes first
        self.running = []
        while queue:
            seq = queue.popleft()
            n = min(seq.num_new, budget)
            if n == 0:
                self.running.append(seq)
                continue
            while not self._reserve(seq, n):
                if self._evict_lru_session():
                    continue
                if queue:
                    self._preempt(queue.pop())
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is not None:
                batch.append((seq, n))
                self.running.append(seq)
                budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if not seq.block_table and self._match_prefix(seq):  # its prefix is being computed: wait
                i += 1
                continue
            n = min(seq.num_new, budget)
            while not self._reserve(seq, n) and self._evict_lru_session():
                pass
            if len(seq.block_table) < self.bm.blocks_for(seq.num_computed + n):
                break  # out of memory: the running sequences must finish (or be preempted) first
            del self.waiting[i]
            seq.status = Status.RUNNING
            if seq.num_computed == 0:
                seq.cache_version = self.version
            self._mark_inflight(seq)
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        if not batch and self.waiting and not self.running:
            self._unpin_waiting()  # queued sessions hold the blocks the head of the queue needs
            return self.schedule(now)
        return batch

    def _unpin_waiting(self) -> None:
        pinned = [s for s in list(self.waiting)[1:] if s.block_table]
        assert pinned, "the head of the queue fits alone (checked in add_request) but got no blocks"
        for s in pinned:
            self._count_drop(s)
            self.bm.release(s.block_table)
            s.block_table, s.num_computed, s.num_registered = [], 0, 0

    def _count_drop(self, seq: Sequence) -> None:
        self.num_dropped += 1
        self.dropped_tokens += seq.num_computed

    def _reserve(self, seq: Sequence, n: int) -> bool:
        need = self.bm.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need > self.bm.num_free:
            return False
        seq.block_table += [self.bm.allocate() for _ in range(need)]
        return True

    def _match_prefix(self, seq: Sequence) -> bool:
        """Share cached full blocks (keeping >= 1 token to compute); True = defer, a running
        sequence is computing the next block of this prompt."""
        if not self.prefix_cache:
            return False
        for i in range(min(len(seq.chain), (len(seq) - 1) // self.bs)):
            key = hash((self.version, seq.chain[i]))
            block = self.bm.lookup(key, tuple(seq.token_ids[i * self.bs:(i + 1) * self.bs]))
            if block is None:
                if key in self._inflight:
                    self.bm.release(seq.block_table)
                    seq.block_table = []
                    return True
                break
            self.bm.acquire(block)
            seq.block_table.append(block)
        seq.num_computed, seq.num_registered = len(seq.block_table) * self.bs, len(seq.block_table)
        return False

    def _mark_inflight(self, seq: Sequence) -> None:
        if seq.cache_version == self.version:
            self._inflight.update(hash((self.version, c)) for c in seq.chain[seq.num_registered:])

    # -- after the step --------------------------------------------------------------------
    def register_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly full blocks to the prefix cache."""
        full = seq.num_computed // self.bs
        self._extend_chain(seq, full)
        for i in range(seq.num_registered, full):
            if seq.cache_version == self.version:
                key = hash((self.version, seq.chain[i]))
                self.bm.register(seq.block_table[i], key, tuple(seq.token_ids[i * self.bs:(i + 1) * self.bs]))
                self._inflight.discard(key)
        seq.num_registered = max(seq.num_registered, full)

    def finish(self, seq: Sequence, now: float) -> None:
        """The turn ended: keep the sequence as an idle session (or free it if too short to find)."""
        self.running.remove(seq)
        self._forget_inflight(seq)
        full = len(seq) // self.bs
        self._extend_chain(seq, full)
        if full == 0 or self.session_ttl_s <= 0:
            self.bm.release(seq.block_table)
            seq.block_table = []
            return
        seq.status, seq.last_used = Status.IDLE, now
        self.idle[seq.seq_id] = seq
        self._idle_index.setdefault(seq.chain[full - 1], []).append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._count_drop(seq)
        self._forget_inflight(seq)
        self.bm.release(seq.block_table)
        seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def preempt_all(self) -> None:
        """Drop every cache (new weights under the ``reprefill`` policy)."""
        while self.idle:
            self._drop_idle(next(iter(self.idle.values())), release=True)
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []
        for seq in self.waiting:
            if seq.block_table:
                self.bm.release(seq.block_table)
                seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0
        self.bm.clear_cache()
        self._inflight.clear()

    # -- sessions and memory ---------------------------------------------------------------
    def _expire(self, now: float) -> None:
        while self.idle:
            s = next(iter(self.idle.values()))
            if now - s.last_used < self.session_ttl_s:
                break
            self._drop_idle(s, release=True)
            self.num_evicted += 1

    def _evict_lru_session(self) -> bool:
        if not self.idle:
            return False
        lru = next(iter(self.idle.values()))
        self._count_drop(lru)
        self._drop_idle(lru, release=True)
        self.num_evicted += 1
        return True

    def _drop_idle(self, s: Sequence, release: bool = False) -> None:
        del self.idle[s.seq_id]
        key = s.chain[len(s) // self.bs - 1]
        self._idle_index[key].remove(s)
        if not self._idle_index[key]:
            del self._idle_index[key]
        if release:
            self.bm.release(s.block_table)
            s.block_table = []

    def _forget_inflight(self, seq: Sequence) -> None:
        if seq.cache_version == self.version:
            self._inflight.difference_update(hash((self.version, c)) for c in seq.chain[seq.num_registered:])

    def _extend_chain(self, seq: Sequence, num_blocks: int) -> None:
        """A block's hash covers its tokens and, when it holds ``<image>`` slots, the digests of their
        patches: identical placeholder ids behind different screenshots never share keys/values."""
        chain, bs, keys = seq.chain, self.bs, seq.image_keys
        while len(chain) < num_blocks:
            i = len(chain)
            content = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if keys:
                content = (content, tuple(keys.get(p) for p in range(i * bs, (i + 1) * bs)))
            chain.append(chain_hash(chain[-1] if chain else 0, content))
