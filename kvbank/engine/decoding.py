"""From a step's logits to tokens: sample, fork `n > 1` families, detokenize, stop.

The decoder says which sequences stopped; finishing them (the tiers, then the scheduler) is the
step's commit (engine/commit.py)."""

from __future__ import annotations

from kvbank.cache.manager import KVCacheManager
from kvbank.engine.admission import Admission
from kvbank.engine.runner import StepLogits
from kvbank.engine.sampler import Sampled, Sampler, token_logprobs
from kvbank.engine.scheduler import ScheduledSeq, Scheduler
from kvbank.engine.sequence import Request, Sequence


class Decoder:
    """Appends each scheduled sequence's next token, and marks the sequences that stop."""

    def __init__(
        self,
        sampler: Sampler,
        admission: Admission,
        manager: KVCacheManager,
        scheduler: Scheduler,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.sampler = sampler
        self.admission = admission
        self.manager = manager
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = admission.max_model_len

    def prompt_logprobs(self, request: Request, result: StepLogits, i: int) -> None:
        """Record the logprobs of the prompt tokens scheduled sequence i computed, if it asked for them."""
        if result.prompt_rows[i] is None:
            return
        first, last = result.prompt_rows[i]
        logprobs = result.logits[first:last].log_softmax(dim=-1)
        k, start = request.params.prompt_logprobs, len(request.prompt_logprobs)
        for j in range(last - first):
            token = request.prompt_token_ids[start + j]
            request.prompt_logprobs.append(token_logprobs(logprobs[j], token, k, self.sampler.token_text))

    def sample(self, batch: list[ScheduledSeq], result: StepLogits, now: float) -> tuple[int, list[Sequence]]:
        """Sample and append a token to every sequence whose prompt is done; returns the tokens
        appended and the sequences they stopped (their finish reason set, still to be finished)."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, item in enumerate(batch):
            row = result.sample_rows[i]
            if row < 0:
                continue
            family = [item.seq] if item.seq.request.forked else self._fork(item.seq)
            seqs.extend(family)
            rows.extend([row] * len(family))
        if not seqs:
            return 0, []
        # one row per sequence, in order (every batch without n > 1): no copy of the logits
        logits = result.logits if rows == list(range(result.logits.shape[0])) else result.logits[rows]
        stopped = [seq for seq, sample in zip(seqs, self.sampler(logits, seqs)) if self._append_token(seq, sample, now)]
        return len(seqs), stopped

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        family = [parent]
        for index in range(1, request.params.n):
            child = parent.fork(index, self.admission.generator(request.params, index))
            self.admission.attach_detokenizer(child)
            self.manager.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            family.append(child)
        request.forked = True
        return family

    def _append_token(self, seq: Sequence, sample: Sampled, now: float) -> bool:
        token = sample.token_id
        seq.token_ids.append(token)
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(sample.top_logprobs)
            seq.cumulative_logprob += sample.logprob
        new_text = seq.detokenizer.push([token]) if seq.detokenizer is not None else ""
        seq.text += new_text
        context = None if seq.kv_policy.unbounded else self.max_model_len
        reason = seq.check_stop(token, len(new_text), self.eos_token_ids, context)
        if reason is not None and not isinstance(reason[1], str) and seq.detokenizer is not None:
            # Bytes held back for an unfinished character end the text as U+FFFD (a whole decode's ending).
            seq.text += (tail := seq.detokenizer.flush())
            reason = seq.check_stop(token, len(tail), self.eos_token_ids, context)
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason
        return True
