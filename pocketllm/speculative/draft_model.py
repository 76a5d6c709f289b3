"""Draft-model speculation: a smaller model of the target's vocabulary (a lower-bit GGUF of the target
itself, say) proposes its greedy continuation, `num_speculative_tokens` tokens a step.

Its KV cache is paged by the target's KV manager: the draft's layers have KV tensors of their own,
indexed by the same block ids, so a block holds its tokens' KV in the target's layers and in the
draft's, and block accounting, preemption and freeing need nothing more. The draft writes the
positions the target has computed (catching up on each request's newest tokens in its first pass
of a step) and those of its own drafts; before drafting it asks the KV manager for the blocks the
drafts and the next verification need. Each request's progress in the draft (how far its KV is
written) lives on a shadow request that shares the target request's block table.

Drafts are the draft model's argmax: a deterministic proposal, which the target's verification
(each draft row sampled from the target's distribution, kept while it matches) accepts with
exactly the probability rejection sampling gives it, so sampled outputs keep the target's
distribution.
"""
from __future__ import annotations

import torch

from pocketllm.core.request import Request, RequestStatus
from pocketllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pocketllm.errors import ConfigurationError
from pocketllm.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0)


class DraftModel:
    kv_lookahead = False  # (its KV at a position reads the tokens up to it)
    DECODE_ROWS = 8  # most tokens a request catches up on in decode rows

    def __init__(self, spec, target):
        """Checks the draft against the target engine (vocabulary, context, capabilities) and
        reads its shape; no weight is read yet."""
        from pocketllm import hub
        from pocketllm.config import EngineArgs
        from pocketllm.core.hub_name import HubName
        from pocketllm.core.kv_layout import KVLayout
        from pocketllm.runner.model_runner import ModelRunner
        from pocketllm.runner.worker import Worker

        self.target = target
        self.num_tokens = spec.num_speculative_tokens
        args = target.args
        model = spec.model
        if args.load_format != "dummy" and (name := HubName.parse(model)) is not None:
            model = str(hub.resolve(name))  # a draft named on the hub, fetched as the model is
        self.args = EngineArgs(model=model, load_format=args.load_format, device=str(target.device),
                               dtype=target.dtype_name, max_num_seqs=args.max_num_seqs, seed=args.seed,
                               enforce_eager=args.enforce_eager, exact_kernels=args.exact_kernels,
                               dequantize_at_load=args.dequantize_at_load, kv_cache_dtype=args.kv_cache_dtype,
                               enable_lora=bool(spec.lora_modules), lora_modules=spec.lora_modules,
                               max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        where = f"the draft model {spec.model!r}"
        if spec.lora_modules and not args.enable_lora:
            raise ConfigurationError(f"{where} has LoRA adapters (lora_modules), the model runs none: "
                                     "start it with enable_lora (--enable-lora)")
        try:
            self.worker = Worker.open(model, self.args, target.device, target.dtype_name)
        except ConfigurationError as e:
            raise ConfigurationError(f"{where}: {e}") from None
        cfg = self.worker.config
        if cfg.vocab_size != target.model_config.vocab_size:
            raise ConfigurationError(f"{where} has a vocabulary of {cfg.vocab_size} tokens, the model "
                                     f"{target.model_config.vocab_size}: a draft model must share the model's tokenizer")
        mine, theirs = self.worker.source.tokenizer(), target.tokenizer
        if mine is not None and theirs is not None and not _same_tokens(mine, theirs):
            raise ConfigurationError(f"{where} has another tokenizer than the model (the same number of tokens, "
                                     "other tokens): a draft model must share the model's tokenizer")
        if cfg.max_position_embeddings < target.max_model_len:
            raise ConfigurationError(f"{where} takes {cfg.max_position_embeddings} positions, fewer than "
                                     f"max_model_len={target.max_model_len}; lower max_model_len")
        if target.kv_layout.windows[0] is not None:
            raise ConfigurationError("a draft model needs a model with full-attention layers (their block "
                                     "table keeps every position)")
        # Every draft layer reads the target's full-attention block table (a sliding draft layer
        # masks its window there).
        self.layout = KVLayout.of([None] * cfg.num_layers)
        self.kv_bytes_per_block = ModelRunner.kv_bytes_per_block(self.worker.runtime.model_class.kv_shape(cfg),
                                                                 self.layout, target.block_size, target.dtype,
                                                                 kv_cache_dtype=args.kv_cache_dtype)
        self.model = self.runner = self.kv = self.lora = None
        self.reserve = 0
        self.shadows: dict[str, Request] = {}
        self.where = where

    def planned_weight_bytes(self) -> int:
        return self.worker.planned_weight_bytes()

    def load(self) -> None:
        self.model = self.worker.load(self.target.max_model_len, seed=self.args.seed + 1)
        try:
            self.lora = self.worker.lora_manager(max_rows=self.target.args.max_num_batched_tokens)
        except ConfigurationError as e:
            raise ConfigurationError(f"{self.where}: {e}") from None

    def bind(self, num_blocks: int, kv, reserve: int) -> None:
        """KV tensors for `num_blocks` block ids of the target's manager `kv`; drafting leaves
        `reserve` blocks free (the scheduler's watermark)."""
        t = self.target
        self.runner = self.worker.build_runner(num_blocks, t.block_size, t.max_model_len,
                                               max_decode_rows=self.args.max_num_seqs, kv_layout=self.layout,
                                               lora=self.lora)
        self.kv, self.reserve = kv, reserve

    # -- drafting --------------------------------------------------------------------------------
    def propose_for(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to `limit` drafts for each (request, limit): one pass of the draft over each request's
        tokens it has not written yet (its prompt, the first time), then a decode pass per draft."""
        live = self.target.scheduler.requests
        for rid in [rid for rid in self.shadows if rid not in live]:
            self._forget(self.shadows.pop(rid))
        drafts: dict[str, list[int]] = {}
        active = []
        for req, limit in wanted:
            # blocks for the drafts' positions and the verification after them, taken now
            if not self.kv.allocate_slots(req, limit, reserve=self.reserve):
                continue
            active.append((self._shadow(req), limit))
            drafts[req.request_id] = []
        # The passes are queued back to back: each takes the token the one before is sampling
        # from the device (the runner's in-flight inputs), and all are read back at the end.
        launched, passes = None, []
        with torch.inference_mode():
            for i in range(max((n for _, n in active), default=0)):
                rows = [(sh, max(1, len(sh.all_token_ids) - sh.num_computed_tokens)) for sh, n in active if n > i]
                # A few tokens to catch up on run as decode rows (the decode kernels and graphs), a
                # prompt as a prefill chunk; decode rows first, as the runner wants them.
                rows.sort(key=lambda r: r[1] > self.DECODE_ROWS)
                out = SchedulerOutput([ScheduledRequest(sh, n, sh.num_computed_tokens, True) for sh, n in rows],
                                      sum(1 for _, n in rows if n <= self.DECODE_ROWS))
                launched = self.runner.launch(out, launched)
                passes.append((rows, launched))
                for sh, n in rows:
                    sh.num_computed_tokens += n
            for rows, launched in passes:
                sampled = self.runner.collect(launched).sampled
                for sh, _ in rows:
                    token = sampled[sh.request_id][0].token_id
                    sh.all_token_ids.append(token)
                    drafts[sh.request_id].append(token)
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _shadow(self, req: Request) -> Request:
        """The request as the draft sees it: the target's tokens and block table, the draft's own
        progress, kept as far as the tokens it computed are still the request's."""
        sh = self.shadows.get(req.request_id)
        if sh is None or sh.num_preemptions != req.num_preemptions:  # new, or its blocks were freed
            if sh is not None:
                self._forget(sh)
            sh = self.shadows[req.request_id] = Request(req.request_id, [], _GREEDY)
            sh.num_preemptions = req.num_preemptions
            sh.status = RequestStatus.RUNNING
            if self.lora is not None and req.lora_name in self.lora.names():  # the draft's adapter of its name
                sh.lora_name, sh.lora_id = req.lora_name, self.lora.identity(req.lora_name)
                if not self.lora.acquire(sh):  # (every slot drafting for other adapters: drafts without)
                    sh.lora_name, sh.lora_id = None, 0
        else:
            # at most up to the last token: its logits give the first draft (if the step before ran
            # without its drafts and its token was the first of them, the draft has that token's KV
            # already, and writes it again)
            tokens, mine = req.all_token_ids, sh.all_token_ids
            same = min(sh.num_computed_tokens, len(tokens) - 1)
            for p in range(max(0, same - self.num_tokens), same):  # its last drafts: right as far as accepted
                if mine[p] != tokens[p]:
                    same = p
                    break
            sh.num_computed_tokens = same
        sh.all_token_ids = list(req.all_token_ids)
        sh.block_tables = req.block_tables
        return sh

    def _forget(self, sh: Request) -> None:
        if self.lora is not None:
            self.lora.release(sh)


def _same_tokens(a, b) -> bool:
    """Whether two tokenizers give the same ids the same tokens, as far as the smaller goes (a GGUF
    file pads its token list to the model's vocabulary with placeholders)."""
    ids_a, ids_b = ({i: t for t, i in tok._backend.get_vocab(with_added_tokens=True).items()} for tok in (a, b))
    return all(ids_a.get(i) == ids_b.get(i) for i in range(min(len(ids_a), len(ids_b))))
