"""Long-context KV policies: which tokens a sequence keeps in the pool once it outgrows its budget.

One module per policy behind `KVPolicy` (base.py), and the registry that spells them. A policy
decides; the `KVEditor` (cache/editor.py) moves blocks and tensors for it. Two families:

- shifting policies (`sink_window`, `context_shift`) keep the first whole blocks of a sequence
  (its sinks, or llama.cpp's `n_keep`) and a run of the most recent ones, dropping whole blocks in
  between. Positions are those of the cache: every kept key acts as if it sat at its slot, so a
  sequence can run past the model's context with constant memory.
- compressing policies (`h2o`, `snapkv`) keep, per layer and KV head, the tokens that attention
  scores rank highest, and compact them into the first slots of the sequence's blocks. Kept keys
  keep their own positions, so a sequence stays within the model's context.

Policies are spelled as strings everywhere: `full`, `sink_window(sinks=4,window=1024)`,
`h2o(heavy=256,recent=256)`, `snapkv(budget=1024,window=64,kernel=5)` (or
`snapkv(compression_ratio=0.75)`, kvpress's fraction removed), `context_shift(keep=256)`, and for
streaming sessions only (kvbank/engine/streams.py) `frame_window(frames=N,sinks=S)`.

A new policy is one module with a `KVPolicy` dataclass plus one entry in `POLICIES`.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import KVPolicy, ScoredPolicy, ShiftingPolicy, keep_top
from kvbank.cache.policies.context_shift import ContextShift
from kvbank.cache.policies.frame_window import FrameWindow
from kvbank.cache.policies.full import Full
from kvbank.cache.policies.h2o import H2O
from kvbank.cache.policies.sink_window import SinkWindow
from kvbank.cache.policies.snapkv import SnapKV, snapkv_keep

POLICIES: dict[str, type[KVPolicy]] = {p.name: p for p in (Full, SinkWindow, H2O, SnapKV, ContextShift, FrameWindow)}
_SPEC = re.compile(r"^\s*([a-z_0-9]+)\s*(?:\((.*)\))?\s*$", re.S)


def parse_policy(spec: str | KVPolicy, stream: bool = False) -> KVPolicy:
    """A policy from its spelling (e.g. "sink_window(sinks=4,window=1024)"), or the policy itself.

    `frame_window` is a stream's policy (`stream=True`) and the only one a stream takes.
    """
    policy = _parse(spec)
    if stream and not isinstance(policy, FrameWindow):
        raise ValueError(f"a stream's policy={str(policy)!r} must be frame_window(frames=N,sinks=S)")
    if not stream and isinstance(policy, FrameWindow):
        raise ValueError(f"kv_policy={str(policy)!r} is a streaming session's policy: pass it to open_stream")
    return policy


def _parse(spec: str | KVPolicy) -> KVPolicy:
    if isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"kv_policy={spec!r} must be a string such as 'sink_window(sinks=4,window=1024)'")
    match = _SPEC.match(spec)
    if match is None or match.group(1) not in POLICIES:
        raise ValueError(f"kv_policy={spec!r} is not one of {', '.join(POLICIES)} (e.g. 'h2o(heavy=256,recent=256)')")
    cls = POLICIES[match.group(1)]
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in known:
            raise ValueError(
                f"kv_policy={spec!r}: {part!r} is not a parameter of {cls.name}; it takes "
                f"{', '.join(f'{name}=' for name in known) or 'none'}"
            )
        kwargs[key] = _number(spec, key, value)
    return cls(**kwargs)


def _number(spec: str, key: str, value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"kv_policy={spec!r}: {key}={value!r} must be a number") from None


#: a stream's policy when none is given, spelled as users write it
DEFAULT_STREAM_POLICY = str(FrameWindow())

__all__ = [
    "DEFAULT_STREAM_POLICY",
    "H2O",
    "POLICIES",
    "ContextShift",
    "FrameWindow",
    "Full",
    "KVPolicy",
    "Limits",
    "ScoredPolicy",
    "ShiftingPolicy",
    "SinkWindow",
    "SnapKV",
    "keep_top",
    "parse_policy",
    "snapkv_keep",
]
