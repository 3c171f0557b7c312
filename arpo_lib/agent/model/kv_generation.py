"""Rollout generation that keeps each episode's KV cache between steps.

The naive path (`HFPolicy.generate` with `kv_cache=False`: Hugging Face `generate` on the whole
conversation, like ARPO's original rollout loop) re-encodes the full history at every step: step t
prefills all t screenshots again, so a 15-step episode prefills about 8x the tokens it has and runs
the vision tower 120 times for 15 screenshots.

Here every live episode keeps the keys/values of the tokens it has already been through. A step
prefills only what was added since (the end of the last response and the new screenshot turn),
so each screenshot passes through the vision tower once; then all episodes decode together in one
left-padded batch over a preallocated cache. That cache (`BatchSlab`, sized by the longest
sequence plus the response cap) is the step's only one: each prefill writes its row in place,
decoding appends to it, and each episode then keeps a compact copy of its row (not a view: the
slab's unused response slots would otherwise stay reserved between steps).

Correct by construction: an entry is reused only when its tokens are a prefix of the new sequence.
A history-limit re-render (a new segment), a different episode or anything unexpected is a miss
and a full prefill. Positions come from the model's own `get_rope_index` over the whole sequence,
so M-RoPE positions equal those of the full forward. Sampling uses the same per-row seeded
Gumbel sampler as the naive path: given the same seeds both paths draw the same tokens (up to
floating-point ties); `tests/agent/model/test_kv_generation.py` checks it step by step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from arpo_lib.agent.model.packing import rope_positions
from arpo_lib.agent.sampling import SeededGumbelSampler


class SlabLayer(DynamicLayer):
    """A cache layer over a preallocated buffer: appending writes in place.

    Transformers' `DynamicLayer` concatenates on every update, copying the whole cache at every
    decoded token; over a 40k-token multi-screenshot context that copy dominates decoding.
    """

    def __init__(self, capacity: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        if keys is not None:
            self._allocate(keys)
            self._write(keys.to(self.dtype), values.to(self.dtype))

    def _allocate(self, like: torch.Tensor) -> None:
        batch, heads, _, dim = like.shape  # (B, H_kv, L, D)
        self.dtype, self.device = like.dtype, like.device
        self.key_buf = like.new_empty(batch, heads, self.capacity, dim)
        self.value_buf = like.new_empty(batch, heads, self.capacity, dim)
        self.is_initialized = True

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = self.length + keys.shape[-2]
        if end > self.capacity:  # grow geometrically (rare: capacity is sized for the call)
            self.capacity = max(end, 2 * self.capacity)
            old_k, old_v = self.key_buf[:, :, :self.length], self.value_buf[:, :, :self.length]
            self._allocate(keys)
            self.key_buf[:, :, :self.length], self.value_buf[:, :, :self.length] = old_k, old_v
        self.key_buf[:, :, self.length:end] = keys
        self.value_buf[:, :, self.length:end] = values
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self._allocate(key_states)
        self._write(key_states.to(self.dtype), value_states.to(self.dtype))
        return self.keys, self.values


class BatchSlab:
    """One generate call's cache, per decoder layer: keys and values of shape (B, H_kv, W + N, D)
    for B left-padded rows of at most W tokens and N new ones, zeroed (padding is masked, and must
    not be NaN). Each row's prefill writes into it in place through `row` and decoding appends to
    it: one allocation per layer and step, no per-row cache beside it."""

    def __init__(self, batch: int, capacity: int, dtype: torch.dtype | None = None):
        self.batch, self.capacity, self.dtype = batch, capacity, dtype
        """`dtype`: what the keys and values are stored in (None: the first keys' dtype)."""
        self.key_buf: torch.Tensor | None = None
        self.value_buf: torch.Tensor | None = None

    def allocate(self, like: torch.Tensor) -> None:
        if self.key_buf is None:
            _, heads, _, dim = like.shape
            self.key_buf = like.new_zeros(self.batch, heads, self.capacity, dim, dtype=self.dtype or like.dtype)
            self.value_buf = torch.zeros_like(self.key_buf)

    def row(self, row: int, offset: int, keys: torch.Tensor | None = None,
            values: torch.Tensor | None = None) -> RowLayer:
        return RowLayer(self, row, offset, keys, values)

    def layer(self, length: int) -> SlabLayer:
        """The whole batch as one cache layer, `length` (= W) positions filled."""
        layer = SlabLayer(self.capacity)
        layer.dtype, layer.device = self.key_buf.dtype, self.key_buf.device
        layer.key_buf, layer.value_buf, layer.length = self.key_buf, self.value_buf, length
        layer.keys, layer.values = self.key_buf[:, :, :length], self.value_buf[:, :, :length]
        layer.is_initialized = True
        return layer


class RowLayer(SlabLayer):
    """Row `row` of a `BatchSlab` from position `offset` (its left padding) on, as a batch-of-one
    cache layer: a prefill writes the row's keys and values straight into the batch."""

    def __init__(self, slab: BatchSlab, row: int, offset: int, keys: torch.Tensor | None = None,
                 values: torch.Tensor | None = None):
        self.slab, self.row, self.offset = slab, row, offset
        super().__init__(slab.capacity - offset, keys, values)

    def _allocate(self, like: torch.Tensor) -> None:
        if self.is_initialized:
            raise RuntimeError("a row of a BatchSlab cannot grow: size the slab for the whole call")
        self.slab.allocate(like)
        self.dtype, self.device = self.slab.key_buf.dtype, like.device
        self.key_buf = self.slab.key_buf[self.row:self.row + 1, :, self.offset:]
        self.value_buf = self.slab.value_buf[self.row:self.row + 1, :, self.offset:]
        self.is_initialized = True


class _Rows:
    """Rows [lo, hi) of a `BatchSlab`, as a slab of their own (views: writes go to the batch's)."""

    def __init__(self, slab: BatchSlab, lo: int, hi: int):
        self.slab, self.lo, self.hi = slab, lo, hi
        self.capacity = slab.capacity

    def allocate(self, like: torch.Tensor) -> None:
        self.slab.allocate(like)

    @property
    def key_buf(self) -> torch.Tensor:
        return self.slab.key_buf[self.lo:self.hi]

    @property
    def value_buf(self) -> torch.Tensor:
        return self.slab.value_buf[self.lo:self.hi]


class PrefillLayer(SlabLayer):
    """The whole `BatchSlab` as the cache of one batched prefill: the batch's T new positions
    (left-padded: row r's n_r new tokens are its last) land at slab positions [W - T, W), of which
    row r keeps only its own last n_r, [W - n_r, W), where they follow its cached tokens; the
    padding's keys never overwrite them. Attention sees [0, W) under `prefill_mask`."""

    def __init__(self, slab: BatchSlab | _Rows, width: int, new_mask: torch.Tensor):
        super().__init__(slab.capacity)
        self.slab, self.width, self.new_mask = slab, width, new_mask  # new_mask: (B, T) bool, the real tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        slab = self.slab
        slab.allocate(key_states)
        t = key_states.shape[-2]
        keep = self.new_mask[:, None, :, None]  # (B, 1, T, 1)
        lo, hi = self.width - t, self.width
        slab.key_buf[:, :, lo:hi] = torch.where(keep, key_states.to(slab.key_buf.dtype), slab.key_buf[:, :, lo:hi])
        slab.value_buf[:, :, lo:hi] = torch.where(keep, value_states.to(slab.value_buf.dtype),
                                                  slab.value_buf[:, :, lo:hi])
        return slab.key_buf[:, :, :hi], slab.value_buf[:, :, :hi]


def prefill_mask(lengths: Sequence[int], new: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """(B, 1, T, W) boolean SDPA mask of a batched prefill (T = max(new)): row r's query j, at slab
    position W - T + j, sees its row's tokens [W - lengths[r], W - T + j]. A padding query (j <
    T - new[r]) sees only the row's last token, so that no row of the softmax is empty (NaN); its
    output is never used."""
    t = max(new)
    length = torch.tensor(lengths, device=device)[:, None, None]  # (B, 1, 1)
    n_new = torch.tensor(new, device=device)[:, None, None]
    query = torch.arange(t, device=device)[None, :, None]  # (1, T, 1)
    key = torch.arange(width, device=device)[None, None, :]  # (1, 1, W)
    real = query >= t - n_new  # (B, T, 1)
    sees = (key >= width - length) & (key <= width - t + query)
    return torch.where(real, sees, key == width - 1)[:, None]


GROUPED_PREFILL = "arpo_grouped_prefill_sdpa"
"""The attention implementation the text model runs under during a batched prefill."""


def grouped_prefill_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, *, scaling: float | None = None,
                         dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Grouped-query attention of a batched prefill without expanding the cache to every head.

    Transformers' SDPA path lets SDPA group the heads itself (`enable_gqa`) only without a mask:
    with the batched prefill's boolean mask it copies every layer's whole cache to all query
    heads (`repeat_kv`: 7x at UI-TARS-7B's 28 heads over 4). Here each key/value head is attended
    by its own query heads in one SDPA call, the key/value head broadcast to them as a view
    (stride 0, no copy), so the fused masked kernels stay eligible. Exact: the same sums as
    `repeat_kv`. Anything else (no mask, one query token, no grouping) goes to transformers' SDPA.

    query: (B, H, T, D); key, value: (B, H_kv, W, D); attention_mask: (B, 1, T, W) bool.
    Returns (B, T, H, D), as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    b, _, t, _ = query.shape
    heads = []
    for g in range(key.shape[1]):
        k = key[:, g:g + 1].expand(b, groups, *key.shape[2:])  # (B, groups, W, D), a view
        v = value[:, g:g + 1].expand(b, groups, *value.shape[2:])
        heads.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, g * groups:(g + 1) * groups], k, v, attn_mask=attention_mask, scale=scaling,
            dropout_p=dropout if module.training else 0.0))
    return torch.cat(heads, dim=1).transpose(1, 2).contiguous(), None


class _GroupedPrefill:
    """Runs the text model's attention through `grouped_prefill_sdpa` for the duration of a
    batched prefill (registered once; the configured SDPA is restored after, even on error)."""

    def __init__(self, model: Any):
        self.text = model.config.get_text_config()

    def __enter__(self) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(GROUPED_PREFILL, grouped_prefill_sdpa)
        self.before = self.text._attn_implementation
        self.text._attn_implementation = GROUPED_PREFILL

    def __exit__(self, *exc: Any) -> None:
        self.text._attn_implementation = self.before


PREFILL_BATCH_TOKENS_CUDA = 8192
"""`prefill_batch_tokens="auto"` on a GPU: new tokens per batched prefill (rows x the longest)."""
PREFILL_MASK_ELEMENTS = 2**28
"""At most this many entries in a batched prefill's (B, 1, T, W) mask (256 MiB of booleans; SDPA
may widen it to the compute dtype): past ~100k-token histories a batch of long turns would not
fit beside the KV caches, and such rows go one by one, as a single row's prefill builds a mask too."""

EOS_CHECK_EVERY = 8
"""Decoded tokens between two host reads of the batch's end-of-sequence mask (each read syncs)."""


def decode_mask(model: Any, attention: torch.Tensor, padded: bool) -> torch.Tensor | dict | None:
    """The attention mask of one decoded token over a left-padded batch (`attention`: (B, L) ones
    and zeros), built here because transformers would read the padding on the host (a device sync
    per token) to decide whether it may drop the mask. What its own mask functions give: none
    without padding; with padding, under SDPA, the (B, 1, 1, L) boolean padding mask."""
    if not padded:
        return None
    text = model.config.get_text_config()
    if text._attn_implementation != "sdpa" or set(getattr(text, "layer_types", None) or []) - {"full_attention"}:
        return attention  # transformers builds it (and syncs)
    return {"full_attention": attention.bool()[:, None, None, :]}


@dataclass
class _Entry:
    """What one episode keeps between steps."""

    ids: list[int]
    """The tokens whose keys/values are cached (a prefix of the episode's next sequence)."""
    n_images: int
    """Screenshots among those tokens (their pixels are never needed again)."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per decoder layer: keys, values of shape (1, H_kv, len(ids), D)."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]


class CachedGenerator:
    """Per-episode KV caches and batched decoding for an `HFPolicy` (see the module docstring)."""

    def __init__(self, policy: Any, prefill_batch_tokens: int | str = "auto"):
        self.policy = policy
        self.prefill_batch_tokens = prefill_batch_tokens
        """Rows prefilled together in one forward while rows x their longest new part stays within
        this many tokens (0: one forward per row; `auto`: `PREFILL_BATCH_TOKENS_CUDA` on a GPU, 0
        on the CPU, where a batch saves no time). Needs SDPA over full attention (else per row)."""
        self.entries: dict[Hashable, _Entry] = {}
        self.kv_dtype: torch.dtype | None = getattr(policy, "compute_dtype", None)
        """What keys and values are kept in: the compute dtype. Under bf16 autocast RoPE hands them
        over in fp32, and SDPA (in autocast's cast list) casts them to bf16 before every attention
        call, so fp32 storage would only double the cache and recast it at every decoded token."""
        self.stats: Counter = Counter()
        """prefill_tokens, decode_tokens, images_encoded, cache_hits, cache_misses (cumulative)."""

    def release(self, key: Hashable) -> None:
        """Forget an episode's cache (it finished, or the weights changed)."""
        self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()

    def _reusable(self, key: Hashable, ids: list[int]) -> _Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        n = len(entry.ids)
        if n < len(ids) and ids[:n] == entry.ids:
            return entry
        return None

    @torch.no_grad()
    def _prefill(self, segment: Any, entry: _Entry | None, slabs: list[BatchSlab], row: int,
                 offset: int) -> tuple[torch.Tensor, int]:
        """Run the not-yet-cached tail of one sequence, its keys and values written into row `row`
        of `slabs` (one per layer) from `offset` on. Returns (logits of the last position (V,),
        next text position)."""
        policy, model = self.policy, self.policy.model
        start = len(entry.ids) if entry else 0
        n_cached_images = entry.n_images if entry else 0
        positions = rope_positions(model, segment.input_ids, segment.mm_token_type_ids, segment.image_grid_thw)
        new_ids = torch.tensor([segment.input_ids[start:]], device=policy.device)  # (1, n)
        inputs: dict[str, Any] = {}
        new_pixels = segment.pixel_values[n_cached_images:]
        if new_pixels:
            inputs["pixel_values"] = torch.cat(new_pixels).to(policy.device)
            inputs["image_grid_thw"] = torch.stack(segment.image_grid_thw[n_cached_images:]).to(policy.device)
        if entry:
            layers = [slab.row(row, offset, k, v) for slab, (k, v) in zip(slabs, entry.kv)]
            entry.kv = []  # in the slab now: nothing of the old copy stays alive through the forward
        else:
            layers = [slab.row(row, offset) for slab in slabs]
        cache = Cache(layers=layers)
        with policy.autocast():
            hidden = model.model(input_ids=new_ids, position_ids=positions[:, :, start:].to(policy.device),
                                 past_key_values=cache, use_cache=True, **inputs).last_hidden_state
            logits = model.lm_head(hidden[:, -1])  # (1, V)
        self.stats["prefill_tokens"] += new_ids.shape[1]
        self.stats["images_encoded"] += len(new_pixels)
        self.stats["cache_hits" if entry else "cache_misses"] += 1
        return logits[0].float(), int(positions.max()) + 1

    def _budget(self) -> int:
        budget = self.prefill_batch_tokens
        if budget == "auto":
            budget = PREFILL_BATCH_TOKENS_CUDA if self.policy.device.type == "cuda" else 0
        text = self.policy.model.config.get_text_config()
        if text._attn_implementation != "sdpa" or set(getattr(text, "layer_types", None) or []) - {"full_attention"}:
            return 0  # the batched mask is SDPA's boolean one over full attention
        return int(budget)

    def _batches(self, new: Sequence[int], width: int) -> list[list[int]]:
        """Rows grouped for prefill, in order: each group's size x its longest new part within
        the budget, and its mask (size x longest x `width` booleans) within
        `PREFILL_MASK_ELEMENTS` (a row over either alone: today's one forward per row)."""
        budget, groups, current = self._budget(), [], []
        for row, n in enumerate(new):
            longest = max(n, *(new[r] for r in current)) if current else n
            if current and ((len(current) + 1) * longest > budget
                            or (len(current) + 1) * longest * width > PREFILL_MASK_ELEMENTS):
                groups.append(current)
                current = []
            current.append(row)
        return groups + [current] if current else groups

    @torch.no_grad()
    def _prefill_rows(self, rows: Sequence[int], segments: Sequence[Any], entries: Sequence[_Entry | None],
                      slabs: list[BatchSlab], lengths: Sequence[int], width: int) -> list[tuple[torch.Tensor, int]]:
        """`_prefill` of several rows in one forward: their new tokens left-padded to the longest
        (T), each row's cached keys written into the slab first, the vision tower run once over
        their new screenshots, the mask `prefill_mask`, grouped-query attention kept
        (`grouped_prefill_sdpa`). Same outputs as row by row, up to
        floating-point rounding (different matmul shapes)."""
        if len(rows) == 1:
            r = rows[0]
            return [self._prefill(segments[r], entries[r], slabs, r, width - lengths[r])]
        policy, model = self.policy, self.policy.model
        device = policy.device
        starts = [len(entries[r].ids) if entries[r] else 0 for r in rows]
        new = [lengths[r] - start for r, start in zip(rows, starts)]
        t = max(new)
        ids = torch.full((len(rows), t), policy.pad_id, dtype=torch.long)  # (b, T), left-padded
        positions = torch.zeros(3, len(rows), t, dtype=torch.long)
        pixels, grids, next_pos = [], [], []
        for i, (r, start, n) in enumerate(zip(rows, starts, new)):
            segment, entry = segments[r], entries[r]
            ids[i, t - n:] = torch.tensor(segment.input_ids[start:])
            rope = rope_positions(model, segment.input_ids, segment.mm_token_type_ids, segment.image_grid_thw)
            positions[:, i, t - n:] = rope[:, 0, start:]
            next_pos.append(int(rope.max()) + 1)
            cached = entry.n_images if entry else 0
            pixels += segment.pixel_values[cached:]
            grids += segment.image_grid_thw[cached:]
            if entry:  # its keys and values so far, right before its new tokens
                lo = width - lengths[r]
                for slab, (k, v) in zip(slabs, entry.kv):
                    slab.allocate(k)
                    slab.key_buf[r, :, lo:lo + start] = k[0]
                    slab.value_buf[r, :, lo:lo + start] = v[0]
                entry.kv = []  # in the slab now
        sub = [_Rows(slab, rows[0], rows[-1] + 1) for slab in slabs]  # groups are consecutive rows
        real = torch.zeros(len(rows), t, dtype=torch.bool, device=device)
        for i, n in enumerate(new):
            real[i, t - n:] = True
        layers = [PrefillLayer(s, width, real) for s in sub]
        mask = prefill_mask([lengths[r] for r in rows], new, width, device)
        inputs: dict[str, Any] = {}
        if pixels:
            inputs["pixel_values"] = torch.cat(pixels).to(device)
            inputs["image_grid_thw"] = torch.stack(grids).to(device)
        with policy.autocast(), _GroupedPrefill(model):
            hidden = model.model(input_ids=ids.to(device), position_ids=positions.to(device),
                                 attention_mask={"full_attention": mask}, past_key_values=Cache(layers=layers),
                                 use_cache=True, **inputs).last_hidden_state
            logits = model.lm_head(hidden[:, -1])  # (b, V)
        self.stats["prefill_tokens"] += sum(new)
        self.stats["images_encoded"] += len(pixels)
        self.stats["cache_hits"] += sum(1 for r in rows if entries[r])
        self.stats["cache_misses"] += sum(1 for r in rows if not entries[r])
        self.stats["batched_prefills"] += 1
        return [(logits[i].float(), next_pos[i]) for i in range(len(rows))]

    @torch.no_grad()
    def generate(self, segments: Sequence[Any], keys: Sequence[Hashable], *, temperature: float, top_p: float,
                 max_new_tokens: int, seeds: Sequence[int] | None,
                 frequency_penalty: float = 0.0) -> list[GenerationResult]:
        policy, model = self.policy, self.policy.model
        if len(set(keys)) != len(keys):
            raise ValueError("cache keys must be distinct within one call (one per live episode)")
        batch = len(segments)
        lengths = [len(s.input_ids) for s in segments]
        width = max(lengths)
        n_layers = model.config.get_text_config().num_hidden_layers
        slabs = [BatchSlab(batch, width + max_new_tokens, self.kv_dtype) for _ in range(n_layers)]
        entries: list[_Entry | None] = [self._reusable(key, segment.input_ids) for segment, key in zip(segments, keys)]
        new = [n - (len(e.ids) if e else 0) for n, e in zip(lengths, entries)]
        rows: list[tuple[torch.Tensor, int]] = []
        for group in self._batches(new, width):
            rows += self._prefill_rows(group, segments, entries, slabs, lengths, width)
            for r in group:  # its keys and values are in the slab now: the episode's old copy goes
                entries[r] = None
        merged = [slab.layer(width) for slab in slabs]
        cache = Cache(layers=merged)
        device = policy.device
        attention = torch.zeros(batch, width, dtype=torch.long, device=device)
        for row, n in enumerate(lengths):
            attention[row, width - n:] = 1
        padded = min(lengths) < width
        next_pos = torch.tensor([pos for _, pos in rows], device=device)  # (B,)
        logits = torch.stack([lg for lg, _ in rows])  # (B, V)

        greedy = temperature <= 0
        sampler = None
        if not greedy:
            if seeds is None:
                seeds = torch.randint(0, 2**31 - 1, (batch,)).tolist()
            sampler = SeededGumbelSampler(seeds, temperature, top_p, policy.suppress_ids)
        scale = 1.0 if greedy else temperature
        eos = torch.tensor(policy.eos_ids, device=device)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        counts = torch.zeros_like(logits) if frequency_penalty else None  # (B, V) tokens generated so far
        # the suppressed ids on the device once: indexing with a host list copies it to the device at every token
        suppress = torch.tensor(policy.suppress_ids, device=device) if policy.suppress_ids else None
        for step in range(max_new_tokens):
            if suppress is not None:
                logits.index_fill_(1, suppress, float("-inf"))
            if counts is not None:  # sampled from, and scored under, the penalised distribution
                logits = logits - frequency_penalty * counts
            scores = sampler(None, logits) if sampler else logits
            token = scores.argmax(dim=-1)  # (B,)
            token = torch.where(finished, torch.full_like(token, policy.pad_id), token)
            logprobs.append(torch.log_softmax(logits / scale, dim=-1).gather(-1, token[:, None])[:, 0])
            tokens.append(token)
            if counts is not None:
                counts[torch.arange(batch, device=device), token] += (~finished).float()
            finished |= torch.isin(token, eos)
            if step == max_new_tokens - 1:
                break
            # Reading `finished` on the host waits for the device, so look only every few tokens;
            # the steps decoded past the last row's end are cut off below.
            if step % EOS_CHECK_EVERY == EOS_CHECK_EVERY - 1 and bool(finished.all()):
                break
            attention = torch.cat([attention, torch.ones(batch, 1, dtype=torch.long, device=device)], dim=1)
            positions = (next_pos + step).view(1, batch, 1).expand(3, batch, 1)
            with policy.autocast():
                hidden = model.model(input_ids=token[:, None], position_ids=positions,
                                     attention_mask=decode_mask(model, attention, padded),
                                     past_key_values=cache, use_cache=True).last_hidden_state
                logits = model.lm_head(hidden[:, -1]).float()

        all_tokens = torch.stack(tokens, dim=1).tolist()  # (B, N)
        all_logprobs = torch.stack(logprobs, dim=1).tolist()
        eos_set = set(policy.eos_ids)
        ends = [next((i + 1 for i, t in enumerate(toks) if t in eos_set), len(toks)) for toks in all_tokens]
        # As if decoding had stopped at the step where the last row ended: the same tokens, and the
        # same generated tokens kept in the cache (the last one sampled is never fed).
        n_steps = max(ends)
        fed = n_steps - 1
        self.stats["decode_tokens"] += batch * n_steps

        results = []
        for row, (segment, key) in enumerate(zip(segments, keys)):
            toks, n = all_tokens[row], ends[row]
            results.append(GenerationResult(toks[:n], all_logprobs[row][:n]))
            kept = min(fed, n)  # generated tokens whose keys/values are in the cache
            lo, hi = width - lengths[row], width + kept
            kv = [(slab.key_buf[row:row + 1, :, lo:hi].clone(), slab.value_buf[row:row + 1, :, lo:hi].clone())
                  for slab in slabs]
            self.entries[key] = _Entry(list(segment.input_ids) + toks[:kept], len(segment.pixel_values), kv)
        return results
