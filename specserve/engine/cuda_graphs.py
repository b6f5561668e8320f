"""CUDA graphs of whole forwards: decodes, verifies, draft-model steps and prefill chunks.

A 135M model's eager step launches ~860 kernels, and on a GPU the launches, not the math, set the step's time
(issue 64's profile: 1.9 ms of GPU work in a 19 ms step). A graph replays the whole forward as one launch. It is
captured once per padded token count T (`BUCKETS`) and attention variant (the longest query's, see
`gpu_attention.QMAX_VARIANTS`), over buffers that stay put: each step writes its inputs into them and replays.

The step's inputs travel as one packed int64 transfer from a pinned buffer, laid out for its bucket T:

    ids [T] | positions [T] | slots [T] | seqs [3, T] (first row, q_len, ctx_len) | tables [T, W] | extra

`extra` holds, for this step only, the slots of the tokens that are drafts already on the device and the rows
whose logits are wanted. Padding tokens write their keys to a sink block past the real ones; padding sequences
have no queries. Every row is independent of the others (attention reads only its own sequence), so the
padding rows' values never reach a real one.

A prefill chunk travels as pieces of at most 32 tokens (`KERNEL_QUERY_CHUNK`), each a "sequence" of the attention
kernel that ends at its own last token (the eager GPU path cuts them the same way), and a step of more tokens
than the largest bucket runs as several replays in order (`split_steps`): a later piece reads the keys that
earlier pieces wrote, in the same replay (the cache write precedes the attention of each layer) or in an earlier
one. An eager prefill step costs ~280 launches of host time (a 135M model's 256-token prompt: 18 ms on the H200,
1.8 ms as a replay). EAGLE drafts (which take features) run eagerly. `SPECSERVE_GRAPH_PREFILL=0`
sends prefill chunks of more than 32 tokens to the eager path, as before.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.step_types import ForwardItem
from specserve.model.attention import KERNEL_QUERY_CHUNK, AttentionMetadata, ShortQueries
from specserve.model.gpu_attention import QMAX_VARIANTS
from specserve.settings import settings

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
STAGING_RING = 4  # pinned input buffers in turn: a draft model runs several forwards before the step's sync


class CudaGraphRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, sink_block: int, max_blocks: int,
                 max_tokens: int):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.sink_slot = sink_block * block_size
        self.width = max_blocks
        self.buckets = [b for b in BUCKETS if b <= max_tokens] or [1]
        size = self.buckets[-1] * (8 + max_blocks)  # the layout above, extra (drafts + logit rows) <= 2 T
        self.device = kv_cache.device
        self.packed = torch.zeros(size, dtype=torch.long, device=self.device)
        self.staging = [torch.zeros(size, dtype=torch.long).pin_memory() for _ in range(STAGING_RING)]
        self.copied = [torch.cuda.Event() for _ in range(STAGING_RING)]  # after each staging buffer's last copy
        self.turn = 0
        # Every graph writes its results into these (one copy each): outputs of its own would pin T x vocab
        # float32 per graph (2.3 GB over a 1B model's graphs).
        self.logits = torch.empty(self.buckets[-1], model.lm_head.weight.shape[0], device=self.device)
        self.hidden = torch.empty(self.buckets[-1], model.config.hidden_size, dtype=model.lm_head.weight.dtype,
                                  device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.prefill = settings.graph_prefill  # prefill chunks past 32 tokens too

    def capture_all(self, max_decodes: int) -> None:
        """Captures, largest first (smaller graphs then reuse the pool's memory), pure-decode steps of up to
        `max_decodes` sequences, verify-shaped steps (up to 8 queries a sequence) and steps with prefill pieces
        (up to 32) of every bucket, so that no step waits for a capture while serving."""
        for bucket in reversed(self.buckets):
            for qmax in reversed(QMAX_VARIANTS):
                if (qmax == 1 and bucket > max_decodes) or (qmax > 8 and not self.prefill):
                    continue
                self.graphs[bucket, qmax] = self._capture(bucket, qmax)

    def can_run(self, items: list[ForwardItem], features) -> bool:
        if features is not None or any(len(it.block_table) > self.width for it in items):
            return False
        if self.prefill:  # drafts on the device only in short items (decodes, verifies): those stay whole
            return all(it.num_tokens <= KERNEL_QUERY_CHUNK or not it.num_device_tokens for it in items)
        return (sum(it.num_tokens for it in items) <= self.buckets[-1]
                and all(it.num_tokens <= KERNEL_QUERY_CHUNK for it in items))

    def forward(self, items: list[ForwardItem], all_hidden: bool, device_ids: torch.Tensor | None):
        """The step's logits rows and hidden states as ModelRunner.forward returns them, from one replay per
        sub-step of at most the largest bucket's tokens."""
        steps = split_steps(items, self.buckets[-1])
        if len(steps) == 1:
            return self._replay(steps[0], all_hidden, device_ids)
        logits, hidden, drafts = [], [], 0
        for step in steps:
            own = sum(it.num_device_tokens for it in step)
            ids = device_ids[drafts:drafts + own] if own else None
            drafts += own
            step_logits, step_hidden = self._replay(step, all_hidden, ids)
            logits.append(step_logits)
            hidden.append(step_hidden)
        return torch.cat(logits), torch.cat(hidden)

    def _replay(self, items: list[ForwardItem], all_hidden: bool, device_ids: torch.Tensor | None):
        num_tokens = sum(it.num_tokens for it in items)
        bucket = next(b for b in self.buckets if b >= num_tokens)
        longest = max(it.num_tokens for it in items)
        qmax = next(n for n in QMAX_VARIANTS if n >= longest)
        if (bucket, qmax) not in self.graphs:
            self.graphs[bucket, qmax] = self._capture(bucket, qmax)
        graph = self.graphs[bucket, qmax]
        staging, num_drafts, num_extra = self._pack(items, bucket)
        base = bucket * (6 + self.width)
        self.packed[:base + num_extra].copy_(staging[:base + num_extra], non_blocking=True)
        self.copied[self.turn].record()
        if num_drafts:
            self.packed[:bucket].index_copy_(0, self.packed[base:base + num_drafts], device_ids)
        graph.replay()
        rows = self.packed[base + num_drafts:base + num_extra]
        if all_hidden:
            return self.logits.index_select(0, rows), self.hidden[:num_tokens].clone()
        return self.logits.index_select(0, rows), self.hidden.index_select(0, rows)

    def _pack(self, items: list[ForwardItem], bucket: int) -> tuple[torch.Tensor, int, int]:
        """Writes the step's inputs into the next pinned staging buffer. Returns it, the number of draft
        slots and the number of extra entries (draft slots, then logit rows)."""
        self.turn = (self.turn + 1) % STAGING_RING
        self.copied[self.turn].synchronize()  # its last copy finished long ago, in practice (unrecorded: no wait)
        staging = self.staging[self.turn]
        return staging, *pack_step(staging.numpy(), items, bucket, self.width, self.block_size, self.sink_slot)

    def _capture(self, bucket: int, qmax: int):
        """Captures the forward of `bucket` tokens over views of the packed buffer (filled with padding first,
        so that the warm-up runs write only the sink block)."""
        t, w = bucket, self.width
        p = self.packed
        pad = torch.zeros(6 * t + t * w, dtype=torch.long)
        pad[2 * t:3 * t] = self.sink_slot
        p[:len(pad)].copy_(pad)  # a blocking copy: before this step's inputs are written again (see forward)
        seqs, tables = p[3 * t:6 * t].view(3, t), p[6 * t:6 * t + t * w].view(t, w)
        meta = AttentionMetadata(p[t:2 * t], p[2 * t:3 * t], [], ShortQueries(seqs, tables, t, qmax))

        def run():
            meta.write_index = None  # derived from slot_mapping inside the captured work
            hidden = self.model(p[:t], meta, self.kv_cache)
            # compute_logits' float32, in the copy
            self.logits[:t].copy_(self.model.softcap(self.model.lm_head(hidden)))
            self.hidden[:t].copy_(hidden)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up: compiles the attention variant, creates the library handles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        self.pool = graph.pool()
        return graph


def pack_step(buf: np.ndarray, items: list[ForwardItem], bucket: int, width: int, block_size: int,
              sink_slot: int) -> tuple[int, int]:
    """Writes a step's inputs into `buf` (int64) in the layout of the module docstring for `bucket` tokens and
    block tables `width` wide. Returns the number of draft slots and of extra entries (draft slots, then logit
    rows). One pass of plain Python over the items, then one numpy write per field: per-item numpy calls cost
    ~6 us an item, most of a 32-sequence decode step's packing."""
    t, w, bs = bucket, width, block_size
    ids, positions, slots, seqs, drafts, rows = [], [], [], [], [], []
    tables = buf[6 * t:6 * t + t * w].reshape(t, w)
    tables[:len(items)] = 0
    for i, it in enumerate(items):
        start, n, ctx, table = len(ids), it.num_tokens, it.ctx_len, it.block_table
        ids += it.token_ids
        if it.num_device_tokens:
            drafts.extend(range(len(ids), start + n))
            ids += [0] * it.num_device_tokens
        rows.extend(range(start + n - it.num_logits, start + n))
        positions.extend(range(ctx - n, ctx))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        seqs.append((start, n, ctx))
        tables[i, :len(table)] = table
    total = len(ids)
    buf[:6 * t] = 0
    buf[:total] = ids
    buf[t:t + total] = positions
    buf[2 * t:3 * t] = sink_slot  # padding tokens write their keys to the sink block
    buf[2 * t:2 * t + total] = slots
    buf[3 * t:6 * t].reshape(3, t)[:, :len(items)] = np.array(seqs, dtype=np.int64).T
    base = 6 * t + t * w
    buf[base:base + len(drafts) + len(rows)] = drafts + rows
    return len(drafts), len(drafts) + len(rows)


def split_steps(items: list[ForwardItem], max_tokens: int) -> list[list[ForwardItem]]:
    """The step's items as sub-steps of at most `max_tokens` tokens, in order, each item longer than
    KERNEL_QUERY_CHUNK cut into pieces of that many tokens (the last shorter): a piece is an item of its own that
    ends at its last token and asks for the logits of the item's logit rows it holds. Items with drafts on the
    device stay whole (they are short). The logits rows and hidden rows of the sub-steps, concatenated, are the
    step's."""
    steps, current, size = [], [], 0
    for it in items:
        if it.num_tokens <= KERNEL_QUERY_CHUNK:
            pieces = [it]
        else:
            first_logit = it.num_tokens - it.num_logits
            start_pos = it.ctx_len - it.num_tokens
            pieces = [ForwardItem(it.token_ids[a:a + KERNEL_QUERY_CHUNK],
                                  start_pos + min(a + KERNEL_QUERY_CHUNK, it.num_tokens), it.block_table,
                                  max(0, min(a + KERNEL_QUERY_CHUNK, it.num_tokens) - max(a, first_logit)))
                      for a in range(0, it.num_tokens, KERNEL_QUERY_CHUNK)]
        for piece in pieces:
            if size + piece.num_tokens > max_tokens and current:
                steps.append(current)
                current, size = [], 0
            current.append(piece)
            size += piece.num_tokens
    return steps + [current] if current else steps
