"""EAGLE-3 head drafts on the torch backend: the drafter llama.cpp's `eagle3` architecture reads (src/models/eagle3.cpp,
written by tandem.synthetic.heads.write_eagle3), as a small module beside a llama target run by tandem's Transformer
(docs/decisions/0004-head-drafts.md).

The same drafting as llama.cpp's (llamacpp_head.Eagle3Drafts, after `common_speculative_impl_draft_eagle3`), so one
file drafts the same on both backends:
- the target's forwards tap the inputs of the drafter's three `target_layers` (TorchBatchedCache.tap: nothing is
  tapped while no head is attached), and `fc` fuses each row's three into g, the drafter's width;
- the drafter keeps a KV of one decoder layer a slot: its position P holds the pair (token P + 1, g at P), written
  once the target has computed both (the last row's pair waits for the next token); unlike llama.cpp's, it writes
  them when the slot next drafts (catch_up), so target steps nobody drafts beside pay for no head work;
- a draft round's first step feeds (the pending token, g at the position before it) at that position, the next
  ones (the draft, the layer's pre-norm output) at the following positions; a round's steps and the pairs of rows a
  verify rejected are dropped when the next pairs are written.
A decoder step: [rms(embed(token)) * attn_norm, rms(state) * attn_norm_2] (2 * d wide) into q, k, v; rope (adjacent
pairs, llama.cpp's NORM); attention over the slot's KV; the residual is the raw state (or its norm, with
`norm_before_residual`); a SwiGLU MLP; its own output norm and lm_head, whose rows map to target ids by `d2t` where
the file has one (the other ids get -inf). Without its own token embedding or lm_head it uses the target's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from tandem.backends.base import BatchedCache, Model
from tandem.config import HeadMismatchError, ModelConfig, head_problems
from tandem.loading.gguf import GGUFError, GGUFFile, open_gguf
from tandem.loading.tokenizer import Tokenizer
from tandem.models.transformer import apply_rope, rms_norm, rope_tables

G_KEPT = 64  # g rows kept a slot behind its newest: a verify's rows, where a round's first draft reads its state
PENDING_MAX = 512  # target rows a slot holds for its next catch-up at most (their features: 3 target widths each)


def eagle3_tensors(gguf: GGUFFile) -> dict[str, tuple[int, ...]]:
    """The tensors an eagle3 file holds, by name and torch shape ([out, in]); the optional ones where present."""
    c = gguf.config
    d, target = c.d_model, c.head_input_width
    q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {
        "fc.weight": (d, 3 * target),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.attn_norm_2.weight": (d,),
        "blk.0.attn_q.weight": (q_width, 2 * d),
        "blk.0.attn_k.weight": (kv_width, 2 * d),
        "blk.0.attn_v.weight": (kv_width, 2 * d),
        "blk.0.attn_output.weight": (d, q_width),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.ffn_gate.weight": (c.d_ffn, d),
        "blk.0.ffn_up.weight": (c.d_ffn, d),
        "blk.0.ffn_down.weight": (d, c.d_ffn),
        "output_norm.weight": (d,),
    }
    draft_vocab = gguf.tensor_shape("d2t")[0] if gguf.has_tensor("d2t") else c.vocab_size
    optional = {"token_embd.weight": (c.vocab_size, d), "output.weight": (draft_vocab, d),
                "enc.output_norm.weight": (3 * target,)}
    shapes.update({name: shape for name, shape in optional.items() if gguf.has_tensor(name)})
    if gguf.get("eagle3.norm_before_fc", False) and "enc.output_norm.weight" not in shapes:
        raise GGUFError(f"{gguf.path}: norm_before_fc is set but the file has no 'enc.output_norm.weight'")
    return shapes


class TorchHeadModel(Model):
    """An EAGLE-3 head draft's weights on the torch backend; it drafts only over a target's cache (attach_head)."""

    backend = "torch"

    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 n_ctx: int | None = None) -> None:
        gguf = open_gguf(path)
        self.path, self.config = str(path), gguf.config
        c: ModelConfig = self.config
        if c.architecture != "eagle3":
            raise ValueError(f"{path}: the torch backend runs eagle3 heads, not {c.architecture!r} (a gemma4 "
                             "assistant needs a gemma4 target, which only the llama.cpp backend runs)")
        if c.n_layers != 1 or len(c.head_target_layers) != 3:
            raise GGUFError(f"{path}: an eagle3 head has one decoder layer and reads 3 target layers, this one "
                            f"{c.n_layers} and {list(c.head_target_layers)}")
        partial_rope = int(gguf.get("eagle3.rope.dimension_count", c.head_dim)) != c.head_dim
        if partial_rope or gguf.has_tensor("rope_freqs.weight"):
            raise GGUFError(f"{path}: partial rope or rope_freqs (llama3 scaling) in an eagle3 head is not run by the "
                            "torch backend; use backend='llama.cpp'")
        self.tokenizer = Tokenizer.from_gguf(gguf)
        self.torch_device = torch.device(device)
        self.device, self.dtype = str(self.torch_device), dtype
        self.n_ctx = n_ctx if n_ctx is not None else c.context_length
        self.norm_before_residual = bool(gguf.get("eagle3.norm_before_residual", False))
        shapes = eagle3_tensors(gguf)
        for name, shape in shapes.items():
            if gguf.tensor_shape(name) != shape:
                raise GGUFError(f"{path}: tensor {name!r} has shape {list(gguf.tensor_shape(name))}, expected "
                                f"{list(shape)}")
        self.w = {name: gguf.tensor(name, dtype=dtype, device=device) for name in shapes}
        # d2t: draft id -> target id, as llama.cpp's graph reads it (int64 rows of the full vocabulary)
        self.d2t = None
        if gguf.has_tensor("d2t"):
            import numpy as np

            self.d2t = torch.from_numpy(np.frombuffer(gguf.raw("d2t").tobytes(), dtype=np.int64).copy()).to(device)
            if self.d2t.numel() and not 0 <= int(self.d2t.min()) <= int(self.d2t.max()) < c.vocab_size:
                raise GGUFError(f"{path}: d2t maps draft ids outside the vocabulary of {c.vocab_size}")

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.head_target_layers

    def new_sequence(self, n_ctx: int | None = None, drafting: bool = False):
        raise ValueError(f"{self.path}: a head draft drafts beside its target's cache (BatchedCache.attach_head), "
                         "not alone")

    def logits(self, ids: Seq[int]) -> torch.Tensor:
        raise ValueError(f"{self.path}: a head draft has no logits of its own; it drafts from a target's states")


class Eagle3Drafts:
    """An EAGLE-3 drafter's state over a target's TorchBatchedCache: its KV (one layer, a slot a sequence), the g
    rows of the newest target rows, each slot's draft round. take_in: after every target forward (its rows wait for
    the slot's next draft round: catch_up); step: a draft."""

    def __init__(self, head: TorchHeadModel, target) -> None:
        """target: a TorchBatchedCache of a llama Transformer (check_head has matched the two)."""
        c, t = head.config, target.model.transformer
        self.head, self.target, self.config = head, target, c
        self.dtype, self.device = t.dtype, t.device
        w = {name: v.to(self.device, self.dtype) for name, v in head.w.items()}
        self.embed = w.get("token_embd.weight", t.w["token_embd.weight"])  # the target's unscaled rows, as llama.cpp
        self.output = w.get("output.weight", t.output)
        self.w, self.d2t = w, None if head.d2t is None else head.d2t.to(self.device)
        self.vocab_size = t.config.vocab_size
        self.q_width, self.kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.k = torch.zeros(target.slots, c.n_kv_heads, target.capacity + 1, c.head_dim, dtype=self.dtype,
                             device=self.device)
        self.v = torch.zeros_like(self.k)
        self.rope = rope_tables(c, c.rope_base, c.rope_scale, target.capacity + 1, self.dtype, self.device)
        self.lengths = [0] * target.slots  # positions of the drafter's KV a slot holds
        self.g: list[dict[int, torch.Tensor]] = [{} for _ in range(target.slots)]  # slot -> position -> g
        self.round: dict[int, tuple[int, int, torch.Tensor]] = {}  # slot -> (target length, next position, state)
        # slot -> the target's rows since its last catch-up: (first position, tokens, features), in order
        self.pending: list[list[tuple[int, Seq[int] | torch.Tensor, torch.Tensor]]] = [[] for _ in range(target.slots)]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g [n, d] of the target layers' inputs [n, 3 * target width] (llama.cpp's ENCODE pass)."""
        features = features.to(self.dtype)
        if "enc.output_norm.weight" in self.w:
            features = rms_norm(features, self.w["enc.output_norm.weight"], self.config.rms_eps)
        return F.linear(features, self.w["fc.weight"])

    def decode(self, slots: Seq[int], tokens: torch.Tensor, positions: Seq[int], states: torch.Tensor,
               logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows (slot, token, position, state [d]) through the decoder layer, their k and v written into the
        slots' KV first (a slot's rows at consecutive positions, each attending to those before it). Returns the
        logits [n, target vocab] (float32; None unless `logits`) and the pre-norm outputs [n, d]."""
        c, w, eps = self.config, self.w, self.config.rms_eps
        n = len(slots)
        states = states.to(self.dtype)
        g_norm = rms_norm(states, w["blk.0.attn_norm_2.weight"], eps)
        h = torch.cat([rms_norm(F.embedding(tokens, self.embed), w["blk.0.attn_norm.weight"], eps), g_norm], -1)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        cos, sin = self.rope[:, pos]  # [n, D/2]
        q = F.linear(h, w["blk.0.attn_q.weight"]).view(n, c.n_heads, c.head_dim).transpose(0, 1)[None]
        k = F.linear(h, w["blk.0.attn_k.weight"]).view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)[None]
        v = F.linear(h, w["blk.0.attn_v.weight"]).view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)
        q, k = apply_rope(q, cos, sin, True)[0], apply_rope(k, cos, sin, True)[0]  # [H, n, D], [H_kv, n, D]
        rows = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        self.k.transpose(1, 2).index_put_((rows, pos), k.transpose(0, 1))
        self.v.transpose(1, 2).index_put_((rows, pos), v.transpose(0, 1))
        attn = self.attend(q, slots, positions, pos)
        x = F.linear(attn, w["blk.0.attn_output.weight"]) + (g_norm if self.head.norm_before_residual else states)
        hn = rms_norm(x, w["blk.0.ffn_norm.weight"], eps)
        x = x + F.linear(F.silu(F.linear(hn, w["blk.0.ffn_gate.weight"])) * F.linear(hn, w["blk.0.ffn_up.weight"]),
                         w["blk.0.ffn_down.weight"])
        if not logits:
            return None, x
        out = F.linear(rms_norm(x, w["output_norm.weight"], eps), self.output).float()
        if self.d2t is not None:  # the draft vocabulary's rows at their target ids; the rest never drafted
            full = torch.full((n, self.vocab_size), -math.inf, dtype=out.dtype, device=self.device)
            out = full.index_copy_(1, self.d2t, out)
        return out, x

    def attend(self, q: torch.Tensor, slots: Seq[int], positions: Seq[int], pos: torch.Tensor) -> torch.Tensor:
        """Each row's attention (q [H, n, D]) over its slot's KV up to its position, every slot at once: a slot's rows
        padded to the most any slot has (a padded row repeats its slot's last and is dropped), the slots' KV
        gathered [B, H_kv, S, D], as Transformer's RaggedAttention does its short spans. Returns [n, H * D]."""
        c, n = self.config, len(slots)
        group, order = c.n_heads // c.n_kv_heads, list(dict.fromkeys(slots))
        members = [[i for i, s in enumerate(slots) if s == slot] for slot in order]
        B, T, span = len(order), max(len(m) for m in members), max(positions) + 1
        index = torch.tensor([m + m[-1:] * (T - len(m)) for m in members], device=self.device)  # [B, T]
        at = torch.tensor(order, device=self.device)
        keys, values = self.k[at, :, :span], self.v[at, :, :span]  # [B, H_kv, S, D]
        # query head h = kv head h // group: row g * T + t of a KV head's group is head g at token t
        qb = q[:, index].view(c.n_kv_heads, group, B, T, c.head_dim).permute(2, 0, 1, 3, 4)
        qb = qb.reshape(B, c.n_kv_heads, group * T, c.head_dim)
        visible = torch.arange(span, device=self.device) <= pos[index][:, :, None]  # [B, T, S]
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        scores = torch.matmul(qb, keys.transpose(-1, -2)).to(acc) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~visible.repeat(1, group, 1)[:, None], -math.inf)
        out = torch.matmul(torch.softmax(scores, -1).to(self.dtype), values)  # [B, H_kv, G * T, D]
        out = out.view(B, c.n_kv_heads, group, T, c.head_dim).permute(0, 3, 1, 2, 4).reshape(B * T, self.q_width)
        real = [b * T + t for b, m in enumerate(members) for t in range(len(m))]
        attn = torch.empty(n, self.q_width, dtype=self.dtype, device=self.device)
        attn[torch.tensor([i for m in members for i in m], device=self.device)] = out[real]
        return attn

    def take_in(self, pieces: Seq[tuple[int, int, Seq[int] | torch.Tensor, torch.Tensor]]) -> None:
        """After a target forward, its pieces (slot, first position, tokens, tapped features [n, 3 * width]), kept
        for the slot's next catch-up (its next draft round, or once PENDING_MAX rows wait): a target step the
        policy does not draft beside pays for no head work. Rows a rewind took back are dropped."""
        full = []
        for slot, start, tokens, features in pieces:
            self._trim(slot, start)
            self.pending[slot].append((start, tokens, features))
            if sum(len(t) for _, t, _ in self.pending[slot]) >= PENDING_MAX:
                full.append(slot)
        self.catch_up(full)

    def _trim(self, slot: int, end: int) -> None:
        """Drop the slot's pending rows at positions >= end."""
        kept = [(start, t[: end - start], f[: end - start]) for start, t, f in self.pending[slot] if start < end]
        self.pending[slot] = kept

    def catch_up(self, slots: Seq[int]) -> None:
        """The slots' pending rows: their g, and every pair (token P + 1, g P) they complete, written into the
        slots' KV."""
        pieces = [(slot, start, tokens, features) for slot in dict.fromkeys(slots)
                  for start, tokens, features in self.pending[slot]]
        for slot in slots:
            self.pending[slot] = []
        if not pieces:
            return
        g = self.fuse(torch.cat([features for *_, features in pieces]))
        pairs: dict[int, list] = {}  # slot -> [(tokens [m], first position, states [m, d])] in position order
        at = 0
        for slot, start, tokens, _ in pieces:
            n = len(tokens)
            rows, kept = g[at : at + n], self.g[slot]
            tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.device)
            before = kept.get(start - 1)
            if before is not None:  # row i's pair (token i, g before it) at the position before
                pairs.setdefault(slot, []).append((tokens, start - 1, torch.cat([before[None], rows[:-1]])))
            elif n > 1:
                pairs.setdefault(slot, []).append((tokens[1:], start, rows[:-1]))
            for position in [p for p in kept if p >= start or p < start + n - G_KEPT]:
                del kept[position]
            for i in range(max(0, n - G_KEPT), n):
                kept[start + i] = rows[i].clone()
            at += n
        slots, tokens, positions, states = [], [], [], []
        for slot, runs in pairs.items():
            first = runs[0][1]
            self.lengths[slot] = min(self.lengths[slot], first)  # rejected drafts' pairs, a round's rows
            if self.lengths[slot] != first:
                continue  # a gap (pairs missing before, as in llama.cpp): this slot drafts without them
            for run_tokens, start, run_states in runs:
                slots += [slot] * len(run_tokens)
                positions += range(start, start + len(run_tokens))
                tokens.append(run_tokens), states.append(run_states)
            self.lengths[slot] = positions[-1] + 1
        if slots:
            self.decode(slots, torch.cat(tokens), positions, torch.cat(states), logits=False)

    def step(self, entries: Seq[tuple[int, int]]) -> torch.Tensor:
        """entries: (slot, its newest token). The logits [n, target vocab] of each entry's next token."""
        for slot, _ in entries:  # rows past the target's length: drafts a verify rejected
            self._trim(slot, self.target.length(slot))
        self.catch_up([slot for slot, _ in entries])
        slots, positions, states, lengths = [], [], [], []
        for slot, _ in entries:
            length = self.target.length(slot)
            kept = self.round.get(slot)
            if kept is not None and kept[0] == length:
                _, position, state = kept
            else:  # a round's first: the pending token's pair, at the position before it
                position = max(0, length - 1)
                self.lengths[slot] = min(self.lengths[slot], position)
                state = self.g[slot].get(position)
                if state is None:
                    state = torch.zeros(self.config.d_model, dtype=self.dtype, device=self.device)
                position = min(position, self.lengths[slot])  # as llama.cpp: rows only next to the last
            slots.append(slot), positions.append(position), states.append(state), lengths.append(length)
        tokens = torch.tensor([int(t) for _, t in entries], dtype=torch.long, device=self.device)
        logits, out = self.decode(slots, tokens, positions, torch.stack(states))
        for i, slot in enumerate(slots):
            self.lengths[slot] = positions[i] + 1
            self.round[slot] = (lengths[i], positions[i] + 1, out[i])
        return logits

    def forget(self, slot: int, length: int) -> None:
        """A new sequence in slot keeps the target's first `length` positions: the pairs before them stay."""
        self.round.pop(slot, None)
        self._trim(slot, length)
        self.lengths[slot] = min(self.lengths[slot], max(0, length - 1))
        for position in [p for p in self.g[slot] if p >= length]:
            del self.g[slot][position]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """dst takes src's first `length` target positions: the pairs within them (each needs the token after its
        position) and their g."""
        self.catch_up([src])
        self.round.pop(dst, None)
        if src != dst:
            self.pending[dst] = []  # rows of the sequence dst held before
        held = min(self.lengths[src], max(0, length - 1))
        if src != dst:
            self.k[dst, :, :held].copy_(self.k[src, :, :held])
            self.v[dst, :, :held].copy_(self.v[src, :, :held])
            self.g[dst] = {p: g for p, g in self.g[src].items() if p < length}
        self.lengths[dst] = held


class TorchHeadCache(BatchedCache):
    """An EAGLE-3 head draft over a target's TorchBatchedCache: its length is the target's (the engine's draft loop
    drafts from each entry's last token; the rest is in the target's states and the drafter's pairs), and a
    rewind starts a new round. Attaching it turns the target's taps on; closing it, off."""

    def __init__(self, head: TorchHeadModel, target) -> None:
        problems = head_problems(target.model.config, head.config)
        if problems:
            raise HeadMismatchError(f"head {head.path!r} cannot draft for {target.model.path!r}: "
                                    + "; ".join(problems))
        self.model, self.target = head, target
        self.slots, self.capacity = target.slots, target.capacity
        self._drafts = Eagle3Drafts(head, target)
        target.tap(head.target_layers, self._drafts)

    def length(self, slot: int) -> int:
        return self.target.length(slot)

    def forward(self, batch: Seq[tuple[int, Seq[int]]], last_only: Seq[bool]) -> list[torch.Tensor]:
        self._check(batch)
        with torch.inference_mode():
            logits = self._drafts.step([(slot, tokens[-1]) for slot, tokens in batch])
        return list(logits.split(1))

    def rewind(self, slot: int, length: int) -> None:
        self._drafts.forget(slot, length)  # a new sequence in slot: the target rewinds itself

    def close(self) -> None:
        if self._drafts is not None:
            if self.target.head is self._drafts:
                self.target.tap((), None)
            self._drafts = None
