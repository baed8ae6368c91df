"""A reference path for long-context policies: one token's forward in plain PyTorch over chosen K/V.

`Recorder` captures, from a real engine run, every computed token's pre-rotation keys and values
in every layer and the logits of every step. `reference_logits` then recomputes tokens' logits
from scratch: each layer attends over exactly the kept tokens' recorded K/V, rotated at
the positions a policy is documented to assign, with no paging, no pool and no policy code.
"""

from __future__ import annotations

import torch

from kvbank.attention.rope import apply_rope


class Recorder:
    """Hooks on an engine's model: pre-rotation K/V per layer in computation order, logits per step."""

    def __init__(self, engine) -> None:
        model = engine.runner.model
        self.model = model
        self.config = engine.model_config
        self.keys: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.values: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.queries: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.logits: list[torch.Tensor] = []
        self._rows = 0
        #: off while the reference path runs the model's modules itself
        self.recording = True
        self._handles = [model.register_forward_pre_hook(self._count)]
        for i, layer in enumerate(model.layers):
            self._handles.append(layer.self_attn.qkv_proj.register_forward_hook(self._capture(i)))
        original = self.compute_logits = model.compute_logits

        def compute_logits(hidden):
            out = original(hidden)
            self.logits.append(out.detach().clone())
            return out

        model.compute_logits = compute_logits

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        del self.model.compute_logits

    def _count(self, module, args) -> None:
        self._rows = args[0].shape[0]

    def _capture(self, index: int):
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def hook(module, args, output) -> None:
            if not self.recording:
                return
            rows = output[: self._rows].detach().float().clone()
            self.queries[index].append(rows[:, :q_size].view(-1, c.num_heads, c.head_dim))
            k = rows[:, q_size : q_size + kv_size].view(-1, c.num_kv_heads, c.head_dim)
            v = rows[:, q_size + kv_size :].view(-1, c.num_kv_heads, c.head_dim)
            self.keys[index].append(k)
            self.values[index].append(v)

        return hook

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, kv_heads, dim] pre-rotation keys and values of every token computed so far."""
        return torch.cat(self.keys[layer]), torch.cat(self.values[layer])


def attention_weights(recorder: Recorder, layer: int) -> torch.Tensor:
    """[kv_heads, queries, keys] causal attention weights of every recorded token over every
    earlier one, each at its own position, summed over the query heads sharing a KV head; in
    float64 from the recorded pre-rotation queries and keys, with no engine code but the rotary."""
    c = recorder.config
    q, k = torch.cat(recorder.queries[layer]), torch.cat(recorder.keys[layer])
    positions = torch.arange(q.shape[0])
    inv_freq = recorder.model.rope_inv_freq
    q = _rotate(q, positions.unsqueeze(-1), inv_freq).double()
    k = _rotate(k, positions.unsqueeze(-1), inv_freq).double()
    k = k.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * recorder.model.layers[layer].self_attn.scale
    logits.masked_fill_(torch.ones_like(logits[0], dtype=torch.bool).triu(1), float("-inf"))
    weights = logits.softmax(dim=-1)
    return weights.view(c.num_kv_heads, -1, *weights.shape[1:]).sum(1)


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions.double().unsqueeze(-1) * inv_freq.double()
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    sin[..., : sin.shape[-1] // 2].neg_()
    return apply_rope(x, emb.cos().float(), sin.float())


@torch.inference_mode()
def reference_logits(recorder: Recorder, checks: list[tuple[int, torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
    """Logits, one row per check `(token, kept, kept_positions, position)`: `token` at RoPE
    `position`, attending in layer l, KV head h over the recorded tokens `kept[l, h]` placed at
    `kept_positions[l, h]`, then over itself.

    Each check is its own single-token forward; they share only the weight matrices, which every
    layer applies to all checks' rows at once (a row's result does not depend on the others)."""
    recorder.recording = False
    try:
        return _reference_logits(recorder, checks)
    finally:
        recorder.recording = True


def _reference_logits(recorder: Recorder, checks: list[tuple[int, torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
    model, c = recorder.model, recorder.config
    inv_freq = model.rope_inv_freq
    group = c.num_heads // c.num_kv_heads
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    x = model.embed_tokens(torch.tensor([token for token, _, _, _ in checks])).float()
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv = attn.qkv_proj(layer.input_layernorm(x)).float()
        past_k, past_v = recorder.kv(index)
        out = torch.empty(len(checks), c.num_heads, c.head_dim)
        for i, (_, kept, kept_positions, position) in enumerate(checks):
            here = torch.tensor([position])
            q = _rotate(qkv[i, :q_size].view(c.num_heads, c.head_dim), here, inv_freq)
            k = _rotate(qkv[i, q_size : q_size + kv_size].view(c.num_kv_heads, c.head_dim), here, inv_freq)
            v = qkv[i, q_size + kv_size :].view(c.num_kv_heads, c.head_dim)
            for h in range(c.num_kv_heads):
                rows = kept[index, h]
                keys = torch.cat((_rotate(past_k[rows, h], kept_positions[index, h], inv_freq), k[h : h + 1]))
                values = torch.cat((past_v[rows, h], v[h : h + 1]))
                heads = slice(h * group, (h + 1) * group)
                weights = (q[heads] @ keys.T * attn.scale).softmax(dim=-1)
                out[i, heads] = weights @ values
        x = x + attn.o_proj(out.view(len(checks), -1).to(x.dtype)).float()
        x = x + layer.mlp(layer.post_attention_layernorm(x)).float()
    return recorder.compute_logits(x)


@torch.inference_mode()
def cache_reference_logits(recorder: Recorder, checks: list[tuple[int, int, list, list]]) -> torch.Tensor:
    """Logits, one row per check `(token, position, cache, own)`: `token` at RoPE `position`, in
    layer l attending over `cache[l]` = (keys, values) [n, kv_heads, dim] exactly as a pool holds
    them (keys already rotated), then over `own[l]` = its own (key, value) [kv_heads, dim] as the
    engine stored them. Plain PyTorch, float32, every check its own single-token forward."""
    recorder.recording = False
    try:
        model, c = recorder.model, recorder.config
        group = c.num_heads // c.num_kv_heads
        q_size = c.num_heads * c.head_dim
        x = model.embed_tokens(torch.tensor([token for token, _, _, _ in checks])).float()
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj(layer.input_layernorm(x)).float()
            out = torch.empty(len(checks), c.num_heads, c.head_dim)
            for i, (_, position, cache, own) in enumerate(checks):
                q = _rotate(
                    qkv[i, :q_size].view(c.num_heads, c.head_dim), torch.tensor([position]), model.rope_inv_freq
                )
                keys = torch.cat((cache[index][0].float(), own[index][0].float().unsqueeze(0)))
                values = torch.cat((cache[index][1].float(), own[index][1].float().unsqueeze(0)))
                for h in range(c.num_kv_heads):
                    heads = slice(h * group, (h + 1) * group)
                    weights = (q[heads] @ keys[:, h].T * attn.scale).softmax(dim=-1)
                    out[i, heads] = weights @ values[:, h]
            x = x + attn.o_proj(out.view(len(checks), -1).to(x.dtype)).float()
            x = x + layer.mlp(layer.post_attention_layernorm(x)).float()
        return recorder.compute_logits(x)
    finally:
        recorder.recording = True


def scribble(storage, block: int, count: int) -> None:
    """Overwrite the first `count` slots of `block` in every layer's per-token tensors (dense K/V,
    codes, per-token scales and zero points) with values far from any K/V the model computes: an
    attention that read those slots would answer differently."""
    for layer in storage.layers:
        for t in layer.tensors:
            if t.dim() < 2 or t.shape[1] != storage.block_size:
                continue  # per-block tensors (KIVI key ranges and grids)
            rows = t[block, :count]
            if t.element_size() == 1:
                rows.view(torch.uint8).fill_(0x5A)
            else:
                rows.fill_(8.0)


def assert_lead_unread(llm, session, question: str, params) -> None:
    """The stream's sequence starts `lead` > 0 slots into its first block (frames have left), and
    scribbling over those slots changes no token and no logprob of an answer to `question`."""
    seq = llm.engine.streams_host.get(session.stream_id).seq
    assert seq.lead > 0
    before = session.ask(question, params).outputs[0]
    scribble(llm.engine.storage, seq.block_table[0], seq.lead)
    after = session.ask(question, params).outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
