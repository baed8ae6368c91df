"""`full`: the policy that keeps every token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import KVPolicy

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq


@dataclass(frozen=True)
class Full(KVPolicy):
    """Keep everything; a sequence is limited by the model's context."""

    name: ClassVar[str] = "full"

    def check(self, limits: Limits) -> None:
        pass

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return prompt_len + max_tokens

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        return 0
