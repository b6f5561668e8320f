"""LLMEngine: add requests, call `step()` until done. One step = schedule -> propose -> one target
forward over prefill chunks, decodes and (k+1)-token verifies together -> sample/verify -> commit."""
from __future__ import annotations

import itertools
import time

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.config import EngineConfig
from specserve.engine.model_runner import ForwardItem, ModelRunner, available_memory_bytes, kv_bytes_per_block
from specserve.engine.outputs import RequestOutput, StepStats
from specserve.engine.sampler import chosen_logprobs, to_probs
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.errors import InvalidRequestError, SpecServeError
from specserve.model.kernels import argmax_rows
from specserve.model.loader import load_model
from specserve.spec.controller import StaticController
from specserve.spec.rejection_sampler import rejection_sample
from specserve.spec.setup import build_proposer, load_drafts

GiB = 1 << 30


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)  # unseeded requests draw their generator seeds from here
        target = load_model(config.model, config.dtype, config.device)
        self.model_config = target.config
        self.tokenizer = target.tokenizer
        self.max_model_len = config.max_model_len or min(target.config.max_position_embeddings, 4096)
        if self.max_model_len > target.config.max_position_embeddings:
            raise SpecServeError(f"max_model_len {self.max_model_len} exceeds the model's context "
                                 f"({target.config.max_position_embeddings})")
        spec = config.speculative_config
        drafts = load_drafts(spec, target, config) if spec else []
        device, dtype = torch.device(config.device), target.model.embed_tokens.weight.dtype
        per_block = kv_bytes_per_block(target.model, config.block_size, dtype)
        for draft in drafts:  # each draft has its own cache tensors over the target's block tables
            per_block += kv_bytes_per_block(draft.model, config.block_size, draft.model.embed_tokens.weight.dtype)
        budget = (config.kv_cache_memory * GiB if config.kv_cache_memory >= 1
                  else config.kv_cache_memory * available_memory_bytes(device))
        num_blocks = config.num_kv_blocks or int(budget // per_block)
        k = spec.num_speculative_tokens if spec else 0
        needed = -(-(self.max_model_len + k) // config.block_size)
        if num_blocks < needed:
            raise SpecServeError(f"the KV cache ({num_blocks * per_block / GiB:.3f} GiB) holds {num_blocks * config.block_size} "
                                 f"tokens, fewer than max_model_len {self.max_model_len} + {k}; "
                                 "raise --kv-cache-memory or lower --max-model-len")
        self.runner = ModelRunner(target.model, num_blocks, config.block_size)
        self.proposer = build_proposer(spec, drafts, target, num_blocks, config.block_size) if spec else None
        self.controller = StaticController(k, self.max_model_len) if spec else None
        # Called as (seq, start, rows [n, hidden]) with the target's final hidden state of every committed
        # position, as an EAGLE draft gets them: `specserve distill` records target features while it generates.
        self.hidden_observer = None
        self.scheduler = Scheduler(BlockManager(num_blocks, config.block_size), config.max_num_seqs,
                                   config.max_num_batched_tokens,
                                   self.controller.draft_limit if self.controller else (lambda seq: 0))
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._ids = itertools.count()
        self.last_stats = StepStats()

    # ---- requests -------------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate a request without touching engine state (safe from any thread)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                "completion). Please reduce the length of the prompt or max_tokens.")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.prepare(prompt, params)
        seq = Sequence(request_id, ids, params, self.tokenizer.eos_token_ids,
                       prompt if isinstance(prompt, str) else None, arrival_time, self.config.device)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at any point and free its KV blocks; its final output comes with the next step."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        seq.finished_time = time.monotonic()
        self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        stats = StepStats()
        t0 = time.perf_counter()
        outputs = [self._output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        sched = self.scheduler.schedule()
        decodes, prefills = sched.decodes, sched.prefills
        stats.num_preempted = len(sched.preempted)
        t1 = time.perf_counter()
        stats.t_schedule = t1 - t0
        if sched.is_empty:
            self.last_stats = stats
            return outputs
        drafts: list[list[int]] = [[] for _ in decodes]
        draft_probs = None
        wants_drafts = any(s.max_drafts for s in decodes)
        if self.proposer is not None and (wants_drafts or (prefills and self.proposer.has_cache)):
            proposal = self.proposer.propose(prefills, decodes, self.controller)
            drafts, draft_probs = proposal.token_ids, proposal.probs
        t2 = time.perf_counter()
        stats.t_draft = t2 - t1

        items, verify = [], []  # verify: (seq, drafts, decode index or None) for rows that sample
        for i, (s, d) in enumerate(zip(decodes, drafts)):
            seq = s.seq
            items.append(ForwardItem(seq.token_ids[seq.num_computed:] + d, len(seq.token_ids) + len(d),
                                     seq.block_table, 1 + len(d)))
            verify.append((seq, d, i))
        for s in prefills:
            seq, end = s.seq, s.seq.num_computed + s.num_tokens
            completes = end == len(seq.token_ids)
            items.append(ForwardItem(seq.token_ids[seq.num_computed:end], end, seq.block_table, int(completes)))
            if completes:
                verify.append((seq, [], None))
            else:
                seq.num_computed = end
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
        observers = []  # who reads the target's hidden state of every committed position
        if self.proposer is not None and self.proposer.reads_target_hidden:
            observers.append(self.proposer.observe_target)
        if self.hidden_observer is not None:
            observers.append(self.hidden_observer)
        logits, hidden = self.runner.forward(items, all_hidden=bool(observers))
        t3 = time.perf_counter()
        stats.t_forward = t3 - t2

        committed, rows = self._verify(logits, verify, draft_probs)
        if observers:
            start = 0
            for j, item in enumerate(items):
                seq = decodes[j].seq if j < len(decodes) else prefills[j - len(decodes)].seq
                valid = len(committed[j]) if j < len(decodes) else len(item.token_ids)
                for observe in observers:
                    observe(seq, item.ctx_len - len(item.token_ids), hidden[start:start + valid])
                start += len(item.token_ids)
        t4 = time.perf_counter()
        stats.t_sample = t4 - t3

        now = time.monotonic()
        for (seq, d, decode_index), tokens, seq_rows in zip(verify, committed, rows):
            if d:
                seq.spec.record(len(d), len(tokens) - 1)
                stats.record(len(d), len(tokens) - 1)
            if decode_index is not None:
                stats.draft_lengths.append(len(d))
            logprobs = (chosen_logprobs(logits[seq_rows[:len(tokens)]], tokens)
                        if seq.params.logprobs else [None] * len(tokens))
            new = []
            finished = False
            for tok, lp in zip(tokens, logprobs):
                new.append(tok)
                if seq.append_token(tok, self.tokenizer, lp):
                    finished = True
                    break
            if seq.first_token_time is None:
                seq.first_token_time = now
            if finished:
                seq.status, seq.finished_time = Status.FINISHED, now
                self.scheduler.remove(seq)
                self.requests.pop(seq.request_id, None)
            else:
                seq.num_computed = len(seq.token_ids) - 1
                self.scheduler.blocks.shrink(seq.block_table, len(seq.token_ids))  # release rejected slots
                if self.proposer is not None:
                    self.proposer.on_commit(seq, len(tokens))
            outputs.append(self._output(seq, new))
        stats.num_decodes = len(decodes)
        stats.num_prefill_tokens = sum(s.num_tokens for s in prefills)
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        stats.kv_usage = self.scheduler.blocks.usage
        stats.t_other = time.perf_counter() - t4
        if self.controller is not None:
            self.controller.observe(stats)
        self.last_stats = stats
        return outputs

    def _verify(self, logits: torch.Tensor, verify, draft_probs) -> tuple[list[list[int]], list[list[int]]]:
        """Rejection-sample every sampling row group; returns committed tokens and each group's logit rows."""
        rows, start = [], 0
        for _, d, _ in verify:
            rows.append(list(range(start, start + len(d) + 1)))
            start += len(d) + 1
        k = max((len(d) for _, d, _ in verify), default=0)
        argmax = argmax_rows(logits).tolist()  # padded in Python: one tensor each, not one op per row
        committed: list[list[int] | None] = [None] * len(verify)
        for greedy in (True, False):
            group = [i for i, (seq, _, _) in enumerate(verify) if seq.params.greedy == greedy]
            if not group:
                continue
            n = len(group)
            padded_argmax = torch.tensor([argmax[rows[i][0]:rows[i][-1] + 1] + [0] * (k + 1 - len(rows[i]))
                                          for i in group], dtype=torch.long)  # [n, k + 1]
            draft_ids = torch.tensor([verify[i][1] + [0] * (k - len(verify[i][1])) for i in group],
                                     dtype=torch.long, device=logits.device).view(n, k)
            p = q = None
            if not greedy:
                p = logits.new_zeros(n, k + 1, logits.shape[-1])
                for g, i in enumerate(group):
                    p[g, :len(rows[i])] = to_probs(logits[rows[i]], [verify[i][0].params] * len(rows[i]))
                if draft_probs is not None and k:
                    idx = [verify[i][2] if verify[i][2] is not None else 0 for i in group]
                    q = draft_probs[idx, :k]
            result = rejection_sample(padded_argmax, p, draft_ids, q, [len(verify[i][1]) for i in group],
                                      [None if greedy else verify[i][0].generator for i in group])
            for g, i in enumerate(group):
                committed[i] = result[g]
        return committed, rows

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        finished = seq.status == Status.FINISHED
        spec = seq.spec.as_dict()
        if seq.draft_index is not None:  # several drafts: say which one served the request
            spec["draft"] = self.proposer.names[seq.draft_index]
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            text=seq.text, token_ids=seq.output_token_ids, delta_text=seq.take_new_text(),
            delta_token_ids=new_tokens, finished=finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            spec=spec,
            metrics={"arrival_time": seq.arrival_time, "first_scheduled_time": seq.first_scheduled_time,
                     "first_token_time": seq.first_token_time, "finished_time": seq.finished_time,
                     "num_prompt_tokens": seq.num_prompt_tokens, "num_output_tokens": seq.num_output_tokens})
