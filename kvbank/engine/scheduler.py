"""Continuous batching: which sequences compute how many tokens this step.

Running sequences go first in priority and arrival order (decodes and unfinished prefill chunks
alike), then waiting ones are admitted by priority, tenant fairness and arrival while the token
budget, the prefill budget (engine/pacing.py), `max_num_seqs` and the pool allow (one whose prefix
is still loading from a tier is passed over until it lands). A request with `n > 1` runs as one
sequence until its prompt is done and then forks, so it is admitted only with room for all n. When
a running sequence cannot grow, the running sequence of lowest priority (the newest among equals) is
preempted, and so is one of lower priority than the first waiting request that finds no room (never
a stream's, engine/streams.py): its full computed blocks are swapped to host RAM when a `Swapper` is
given and wants it (they are written back on re-admission), else it is recomputed from its
prefix-cache hits.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbank.cache.manager import KVCacheManager
from kvbank.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the scheduler stays free of tensors; only the engine builds a Swapper
    from kvbank.cache.swap import Swapper


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    #: block copies (source, destination) to make before this step writes: copy-on-write splits
    copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Priority, fair-share and FCFS scheduler with chunked prefill under per-step token budgets."""

    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        swapper: Swapper | None = None,
    ) -> None:
        self.manager = manager
        self.swapper = swapper
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: requests that waited for a running prefill to cache prompt blocks they share
        self.num_prefix_waits = 0
        #: prompt tokens the next step may prefill beside its decodes (engine/pacing.py); None: the budget
        self.prefill_budget: int | None = None
        #: prompt tokens admitted for each tenant with waiting requests, and where the last admitted
        #: request's tenant stood before it (weighted fair queueing's start tags and virtual time)
        self.served: dict[str | None, int] = {}
        self.fair_clock = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def gauges(self) -> dict[str, int]:
        """Requests running and waiting now, preemptions so far, and waits for a shared prefix."""
        return {
            "num_requests_running": len({s.request.request_id for s in self.running}),
            "num_requests_waiting": len({s.request.request_id for s in self.waiting}),
            "num_preemptions": self.num_preemptions,
            "num_prefix_waits": self.num_prefix_waits,
        }

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running set right away (it shares its parent's blocks)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    @property
    def num_seq_slots(self) -> int:
        """Sequences running now, counting the siblings unforked requests will fork into."""
        return sum(map(_slots, self.running))

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        # Decodes (one token) take only the token budget; prompt chunks also the prefill budget.
        prefill = budget if self.prefill_budget is None else self.prefill_budget
        scheduled: list[ScheduledSeq] = []
        preempted = False
        self._preempt_for_priority(min(budget, prefill))
        i = 0
        fresh = prefill
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new, cost = _portion(seq, budget, prefill, prefill == fresh)
            if num_new == 0:  # a stream whose next frame waits for room (StreamHost.fit), or no prefill left
                i += 1
                continue
            room, preempted_some = self._make_room(i, num_new)
            preempted = preempted or preempted_some
            if room:
                scheduled.append(ScheduledSeq(seq, num_new, self.manager.append_slots(seq, num_new)))
                budget -= cost
                prefill -= cost if num_new > 1 else 0
                i += 1
            elif seq.status is SequenceStatus.RUNNING:
                i += 1  # nothing it may preempt: it waits until blocks are freed
        slots = self.num_seq_slots
        # Prompt blocks this step's prefills compute: a waiting sequence whose prompt shares one
        # waits for it to be cached instead of computing it a second time beside them.
        computing = {h for s in scheduled for h in self.manager.computing(s.seq)} if self.waiting else set()
        for seq in self._waiting_in_order() if not preempted else []:
            chunk = min(budget, prefill)
            if chunk <= 0:
                break
            if seq.loading:  # its prefix is on its way from a tier; later ones need not wait for it
                continue
            whole = self.swapper is not None and self.swapper.is_whole(seq)
            if not whole and computing and not computing.isdisjoint(self.manager.computing(seq)):
                if not seq.waited_for_prefix:
                    seq.waited_for_prefix = True
                    self.num_prefix_waits += 1
                continue
            if slots + _slots(seq) > self.max_num_seqs or not self._fits(seq, whole, chunk):
                break
            if seq.blend is not None and _portion(seq, budget, prefill, prefill == fresh)[0] == 0:
                break  # its blend runs whole, in a step with room for it
            slots += _slots(seq)
            self.waiting.remove(seq)
            if whole:  # an edited sequence comes back exactly as it left, and grows from there
                self.swapper.swap_in(seq)
                num_new = min(seq.num_schedulable, chunk)
                copies = self.manager.append_slots(seq, num_new)
            else:
                self.manager.allocate(seq, chunk)
                if self.swapper is not None and self.swapper.is_swapped(seq):
                    self.swapper.swap_in(seq)
                num_new, copies = min(seq.num_schedulable, chunk), []
            cost = num_new
            if seq.blending:
                num_new, cost = _portion(seq, budget, prefill, True)
            seq.status = SequenceStatus.RUNNING
            computing.update(self.manager.computing(seq))
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            scheduled.append(ScheduledSeq(seq, num_new, copies))
            budget -= cost
            prefill -= cost if num_new > 1 else 0
            tenant = seq.request.tenant
            if tenant in self.served:  # charged what it will prefill, less what the cache gave it
                self.fair_clock = self.served[tenant]
                self.served[tenant] += seq.num_pending
        # Decodes first keeps their single-token attention in one batched call.
        scheduled.sort(key=lambda s: s.num_tokens > 1)
        return scheduled

    def _waiting_in_order(self) -> list[Sequence]:
        """The waiting sequences in admission order: by priority (lower first), then, among several
        tenants, the one admitted the fewest prompt tokens first (a tenant with many queued requests
        does not starve one with a single request; one that starts waiting joins where the last
        admitted request's tenant stood, so it goes next but cannot take more than its turn), then as
        queued (arrival, with preempted sequences back in front). With one tenant and one priority,
        the queue's own order."""
        waiting = list(self.waiting)
        tenants = {s.request.tenant for s in waiting}
        self.served = {t: self.served.get(t, self.fair_clock) for t in tenants}
        if len(tenants) > 1 or any(s.request.params.priority != waiting[0].request.params.priority for s in waiting):
            rank = {id(s): i for i, s in enumerate(waiting)}
            waiting.sort(key=lambda s: (s.request.params.priority, self.served[s.request.tenant], rank[id(s)]))
        return waiting

    def _preempt_for_priority(self, chunk: int) -> None:
        """Preempt running sequences of a lower priority (a higher value) than the first waiting one,
        lowest first, while it has no room (blocks for its first chunk, or a sequence slot): with a
        full pool an urgent request does not wait for a long reply of lesser priority to finish, as
        under vLLM's priority policy. Equal priorities never preempt each other."""
        head = next((s for s in self._waiting_in_order() if not s.loading), None) if self.waiting else None
        if head is None or chunk <= 0:
            return
        whole = self.swapper is not None and self.swapper.is_whole(head)
        while self.num_seq_slots + _slots(head) > self.max_num_seqs or not self._fits(head, whole, chunk):
            victim = next((s for s in reversed(self.running) if s.preemptible), None)
            if victim is None or victim.request.params.priority <= head.request.params.priority:
                return
            self._preempt(victim)

    def _fits(self, seq: Sequence, whole: bool, budget: int) -> bool:
        if not whole:
            return self.manager.can_allocate(seq, budget)
        return self.manager.num_free_blocks >= self.swapper.blocks_to_resume(seq, budget)

    def park(self, seq: Sequence) -> None:
        """Take a stream's sequence out of the running set between frames; it keeps its blocks."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED

    def _make_room(self, i: int, num_new: int) -> tuple[bool, bool]:
        """(whether running sequence i can grow by `num_new` now, whether anything was preempted for
        it); victims are the newest preemptible sequences not scheduled yet this step, itself included."""
        seq, preempted = self.running[i], False
        while not self.manager.can_append(seq, num_new):
            victim = next((s for s in reversed(self.running[i:]) if s.preemptible), None)
            if victim is None:
                return False, preempted
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.manager.free(seq)
        if self.swapper is not None:
            self.swapper.discard(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        swapper = self.swapper
        if swapper is not None and swapper.wants_swap(seq) and swapper.can_swap_out(seq):
            swapper.swap_out(seq)
        self.manager.free(seq)
        seq.reset_cache()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _portion(seq: Sequence, budget: int, prefill: int, fresh: bool) -> tuple[int, int]:
    """(tokens `seq` computes this step, what they take of the token budgets). A blended prompt's
    blend (engine/blend.py) runs whole, for what it costs: in a step with room for it, or in one
    where no prompt has taken any of the budget yet (`fresh`); else not this step."""
    n = seq.num_schedulable
    if seq.blending and n > 1:
        cost = seq.blend.cost(n)
        return (n, cost) if fresh or cost <= min(budget, prefill) else (0, 0)
    n = min(n, budget)
    if n > 1:
        n = min(n, prefill)
    return n, n


def _slots(seq: Sequence) -> int:
    return 1 if seq.request.forked else seq.request.params.n
