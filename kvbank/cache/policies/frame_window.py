"""`frame_window`: a streaming session's policy, which keeps or evicts whole frames."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import KVPolicy, require_int

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq
    from kvbank.cache.frames import Frame


@dataclass(frozen=True)
class FrameWindow(KVPolicy):
    """A stream's policy: its system prompt, its leading frames up to `sinks` tokens in all (whole
    frames; none when the system prompt has that many), and the last `frames` frames.

    A frame is the unit: it is kept or evicted whole, however many blocks it spans. The kept frames
    stay where they are and the leading tokens are written again just before them
    (`KVEditor.remove_tokens`), so the sequence may start a few slots into its first block.
    Positions are assigned in the cache as with sink_window. A sequence forked from a stream to
    answer a question keeps everything.
    """

    name: ClassVar[str] = "frame_window"
    unbounded: ClassVar[bool] = True
    #: frames leave from the middle of the sequence and recall brings them back in the model dtype
    needs: ClassVar[frozenset[str]] = frozenset({"rotate", "tokens", "gather"})
    frames: int = 64
    sinks: int = 4

    def __post_init__(self) -> None:
        require_int(self, "frames", self.frames, minimum=1)
        require_int(self, "sinks", self.sinks, minimum=0)

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return prompt_len + max_tokens  # a stream's frames vary in length: it is checked frame by frame

    def pristine_blocks(self, block_size: int) -> int:
        return 0  # the kept leading tokens are known only once the stream has its frames

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        return self.evict(seq, editor, self.victims(seq))

    def victims(self, seq: PolicySeq) -> list[Frame]:
        """The frames the window lets go now (a stream may archive them before `evict`)."""
        log = getattr(seq, "frames", None)
        return [] if log is None else log.evictable(seq.num_computed_tokens, self.frames)

    def evict(self, seq: PolicySeq, editor: KVEditor, victims: list[Frame]) -> int:
        """Remove `victims` (from `victims`) from the sequence and its cache; returns tokens evicted."""
        if not victims:
            return 0
        log = seq.frames
        first, count = victims[0].start, sum(frame.length for frame in victims)
        editor.remove_tokens(seq, first, count, keep=log.keep_tokens)
        log.evicted(victims)
        return count
