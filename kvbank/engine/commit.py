"""The work after a step, in one place: what happens to every sequence the step ran, and in what order."""

from __future__ import annotations

from collections.abc import Callable

from kvbank.cache.editor import KVEditor
from kvbank.cache.manager import KVCacheManager
from kvbank.cache.offload import KVOffload
from kvbank.engine.counters import EngineCounters
from kvbank.engine.decoding import Decoder
from kvbank.engine.runner import StepLogits
from kvbank.engine.scheduler import ScheduledSeq, Scheduler
from kvbank.engine.sequence import Sequence
from kvbank.engine.stream_host import StreamHost


class StepCommit:
    """Settles the sequences a step ran: records, commits, evicts, samples, finishes (see `__call__`).
    What becomes of their requests and streams (outputs, frame requests, waiting questions) is the
    engine's to say afterwards."""

    def __init__(
        self,
        manager: KVCacheManager,
        offload: KVOffload | None,
        editor: KVEditor,
        scheduler: Scheduler,
        streams_host: StreamHost,
        decoder: Decoder,
        counters: EngineCounters,
        prefix_caching: bool,
        fail: Callable[[Sequence, Exception], None],
    ) -> None:
        self.manager = manager
        self.offload = offload
        self.editor = editor
        self.scheduler = scheduler
        self.streams_host = streams_host
        self.decoder = decoder
        self.counters = counters
        self.prefix_caching = prefix_caching
        #: ends what a sequence belongs to when settling it raised (LLMEngine._fail)
        self.fail = fail

    def __call__(self, batch: list[ScheduledSeq], result: StepLogits, now: float) -> list[Sequence]:
        """Settle every sequence of `batch`, in this order. First, each in turn: its request's first
        scheduling is recorded (and offered to the tiers), its prompt logprobs are taken, its computed
        tokens are committed to the prefix index and then to the tiers, and what its policy (a
        stream's window) lets go is evicted; one that raises fails alone (`fail`) and gets no token.
        Then every sequence whose prompt is done gets its next token (an n > 1 family forks first),
        and those that stopped are finished: the tiers take their last blocks, then the scheduler
        frees them. Returns the sequences settled, in batch order."""
        settled = []
        for i, item in enumerate(batch):
            try:
                self._record(item, result, i, now)
                self._commit(item.seq)
            except Exception as error:
                result.sample_rows[i], result.prompt_rows[i] = -1, None
                self.fail(item.seq, error)
                continue
            settled.append(item.seq)
        appended, stopped = self.decoder.sample(batch, result, now)
        self.counters.generation_tokens += appended
        for seq in stopped:
            self._finish(seq)
        return settled

    def _record(self, item: ScheduledSeq, result: StepLogits, i: int, now: float) -> None:
        seq, request = item.seq, item.seq.request
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = seq.num_computed_tokens
            self.counters.scheduled_first(seq, self.prefix_caching)
            if self.offload is not None:
                self.offload.on_admit(seq)
        self.decoder.prompt_logprobs(request, result, i)
        seq.num_computed_tokens += item.num_tokens

    def _commit(self, seq: Sequence) -> None:
        self.manager.commit(seq)
        if self.offload is not None:
            self.offload.on_commit(seq)
        if seq.frames is not None:
            evicted = self.streams_host.after_step(seq)
        else:
            evicted = seq.kv_policy.after_step(seq, self.editor)
        if evicted:
            self.counters.evicted_tokens[seq.kv_policy.name] += evicted

    def _finish(self, seq: Sequence) -> None:
        if self.offload is not None:
            self.offload.on_finish(seq)
        self.scheduler.finish(seq)
