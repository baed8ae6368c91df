"""A prompt's documents and how they are blended (engine/blend.py runs the blend): the spans a
prompt marks, from segments or a separator, and the plan a request carries."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbank.cache.prefix import root_hash

#: the layer whose K/V deviation selects the tokens to recompute (layer 0 sees no context in its K/V)
CHECK_LAYER = 1


#: whether documents are computed after the model's BOS token (BlendPlan.lead). Off: measured on
#: the bundled model (bench/blend.py --lead-bos), it lowers pure reuse's error (ratio 0: answer
#: perplexity +7.9% instead of +18.7%) but not the default ratio's (+5.9% against +5.6%), and it
#: ties a document's cached blocks to the token it was computed after.
LEAD_WITH_BOS = False


def document_lead(tokenizer) -> tuple[int, ...]:
    """The tokens every document is computed after when computed alone (BlendPlan.lead)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return (bos,) if LEAD_WITH_BOS and bos is not None else ()


def document_root(namespace: bytes, salt: str | None) -> bytes:
    """The chain root of documents' blocks: the model's fingerprint and the tenant's salt, apart from
    every prompt's chain (a prompt that starts with a document's tokens is not that document)."""
    return root_hash(namespace + b"|document|", salt)


@dataclass(frozen=True, slots=True)
class Document:
    """A document's place in a prompt: tokens [start, end)."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class BlendPlan:
    """A blended prompt: its documents, the share recomputed, where document chains start."""

    documents: list[Document]
    ratio: float
    root: bytes
    num_layers: int
    #: tokens a document is computed after when it is computed alone (not placed): the position a
    #: prompt's first token holds, so that the document's own first tokens do not become the
    #: attention sink a prompt's first token is
    lead: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """Where the blend ends: the last document's end (what follows is computed as usual)."""
        return self.documents[-1].end

    def cost(self, tokens: int) -> int:
        """Prefill tokens a blend of `tokens` tokens costs about as much as (the scheduler's budget):
        tokens outside documents in full, document tokens for the check layers and their share."""
        inside = min(tokens, sum(d.length for d in self.documents))
        share = (CHECK_LAYER + 1 + (self.num_layers - CHECK_LAYER - 1) * self.ratio) / self.num_layers
        return max(1, math.ceil(tokens - inside + inside * share))

    def stored_end(self, doc: Document, block_size: int) -> int:
        """Where the document's cached part ends: its chain (`lead` and the document) is cached in
        whole blocks, and the tokens of its last partial block are always recomputed."""
        lead = len(self.lead)
        return doc.start + max(0, (lead + doc.length) // block_size * block_size - lead)

    def stored_tokens(self, doc: Document, token_ids, block_size: int) -> list[int]:
        """The tokens of the document's cached chain: `lead` and the document's cached part."""
        return [*self.lead, *token_ids[doc.start : self.stored_end(doc, block_size)]]


def segment_prompt(segments: Any, encode: Callable[[str, bool], list[int]]) -> tuple[list[int], list[Document]]:
    """Token ids of a prompt given as segments, and its documents' spans.

    A segment is text, a list of token ids, or {"document": text or token ids}; texts are tokenized
    one by one (special tokens added to the first segment only), so a document has the same tokens
    wherever it stands."""
    if not isinstance(segments, list) or not segments:
        raise ValueError("segments must be a non-empty list of texts, token id lists or {'document': ...}")
    token_ids: list[int] = []
    documents: list[Document] = []
    for i, segment in enumerate(segments):
        document = isinstance(segment, dict)
        if document:
            if set(segment) != {"document"}:
                raise ValueError(f"segments[{i}] has keys {sorted(segment)}; a document segment has only 'document'")
            segment = segment["document"]
        if isinstance(segment, str):
            ids = encode(segment, i == 0 and not document)
        elif isinstance(segment, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in segment):
            ids = list(segment)
        else:
            raise ValueError(f"segments[{i}] must be a string, a list of token ids or {{'document': ...}}")
        if document and ids:
            documents.append(Document(len(token_ids), len(token_ids) + len(ids)))
        token_ids.extend(ids)
    return token_ids, documents


def separator_segments(text: str, separator: str) -> list | None:
    """`text` split at `separator` into segments: the pieces between two separators are documents,
    the first and last piece and the separators themselves are plain text. None if it has none."""
    pieces = text.split(separator)
    if len(pieces) < 3:
        return None
    segments: list = [pieces[0]]
    for piece in pieces[1:-1]:
        segments += [separator, {"document": piece}]
    return [*segments, separator, pieces[-1]]


def tokenized_segments(segments: list, encode: Callable[..., list[int]], special: bool = True) -> list:
    """`segments` with their texts replaced by token ids, as `segment_prompt` would tokenize them
    (without `special`, no special tokens at all: a chat template's text writes its own)."""
    out: list = []
    for i, segment in enumerate(segments):
        if isinstance(segment, dict) and isinstance(segment.get("document"), str):
            out.append({"document": encode(segment["document"], add_special_tokens=False)})
        elif isinstance(segment, str):
            out.append(encode(segment, add_special_tokens=special and i == 0))
        else:
            out.append(segment)
    return out


def rendered_prompt(text: str, separator: str | None, encode: Callable[..., list[int]]) -> list[int] | dict:
    """A chat template's rendered `text` as a prompt: its token ids (the template writes the special
    tokens), or {"segments": ...} cut at `separator` where the text holds it."""
    segments = separator_segments(text, separator) if separator is not None else None
    if segments is None:
        return encode(text, add_special_tokens=False)
    return {"segments": tokenized_segments(segments, encode, special=False)}
