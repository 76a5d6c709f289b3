"""Drafts from the model's own next-token-prediction layer (speculative method "mtp", DeepSeek-V3's).

After every step of the model the layer runs over the rows that step computed from real tokens: at
position q it reads the model's final hidden state there and token q + 1 (known once the step's
tokens are sampled), and writes its one-layer KV cache at q, on the model's block ids as a draft
model's cache is. At a request's newest position it predicts the token after the one just sampled:
the first draft. Further drafts chain the layer on its own output state, one position a pass; that
writes its KV past the newest position, and the next step's pass overwrites it from the model's
hidden states.

Running the layer after every step, drafting or not, keeps its cache whole for every position the
model computed, as the prefix cache needs: a block another request adopts holds the layer's KV of
its tokens too. That KV also read the token after the block's last, so a hit leaves its last block
to compute (`kv_lookahead`): the blocks adopted are then followed by one whose tokens matched.
(A request's last position is left out when it finishes in that step.)
"""
from __future__ import annotations

import torch

from pocketllm.core.kv_layout import KVLayout
from pocketllm.core.request import Request, RequestStatus
from pocketllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pocketllm.errors import ConfigurationError
from pocketllm.loaders.safetensors_loader import tensor_names
from pocketllm.runner.model_runner import ModelRunner
from pocketllm.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0)


class MTPProposer:
    kv_lookahead = True  # the layer's KV at q reads token q + 1: a prefix hit drops its last block
    DECODE_ROWS = 8  # rows of one request run as decode rows up to this many (the decode kernels and graphs)

    def __init__(self, spec, target):
        """`target`: the engine, its model's configuration and capabilities checked, no weight read."""
        if target.source.is_gguf:
            raise ConfigurationError("speculative method mtp reads the next-token-prediction layer of a "
                                     "safetensors checkpoint; GGUF files are loaded without it")
        layer = f"model.layers.{target.model_config.num_layers}."
        if not target.source.dummy and not any(n.startswith(layer) for n in tensor_names(target.source.path)):
            raise ConfigurationError(f"speculative method mtp: the checkpoint declares num_nextn_predict_layers but "
                                     f"holds no tensor of its next-token-prediction layer ({layer}*)")
        self.target = target
        self.num_tokens = spec.num_speculative_tokens
        self.layout = KVLayout.of([None])
        self.kv_bytes_per_block = ModelRunner.kv_bytes_per_block(target.runtime.model_class.kv_shape(target.model_config),
                                                                 self.layout, target.block_size, target.dtype,
                                                                 kv_cache_dtype=target.args.kv_cache_dtype)
        self.model = self.runner = self.kv = None
        self.reserve = 0
        # request id -> (its tokens when drafted, the first draft, the layer's output state there)
        self.first: dict[str, tuple[int, int, torch.Tensor]] = {}

    def planned_weight_bytes(self) -> int:
        """About one decoder layer's share of the model's (the layer is one MoE decoder layer and a projection)."""
        return self.target.worker.planned_weight_bytes() // self.target.model_config.num_layers

    def load(self) -> None:
        t = self.target
        model = t.worker.model
        self.model = t.source.load(lambda cfg, **kw: model.draft_module(**kw), t.dtype, t.device, t.max_model_len,
                                   seed=t.args.seed + 1, dequantize_at_load=t.args.dequantize_at_load,
                                   exact_kernels=t.args.exact_kernels)

    def bind(self, num_blocks: int, kv, reserve: int) -> None:
        """The layer's KV tensors for `num_blocks` block ids of the model's manager `kv`; drafting leaves
        `reserve` blocks free (the scheduler's watermark)."""
        t = self.target
        self.runner = ModelRunner(self.model, num_blocks, t.block_size, t.dtype, t.device, t.args.seed,
                                  max_decode_rows=t.args.max_num_seqs, max_model_len=t.max_model_len,
                                  enforce_eager=True, kv_layout=self.layout)
        self.runner.keep_hidden = True  # chained drafts read the layer's own output state
        t.runner.keep_hidden = True
        self.kv, self.reserve = kv, reserve

    # -- after each step ------------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, hidden: torch.Tensor | None, sampled: dict[str, list]) -> None:
        """The layer over the step's rows of real tokens (`hidden`: the model's, a row per computed token in
        the step's order; `sampled`: request id -> its new tokens), and each request's first draft."""
        live = self.target.scheduler.requests
        self.first = {rid: f for rid, f in self.first.items() if rid in live}
        rows, off = [], 0
        for sr in sched.scheduled:
            req, start = sr.request, off
            off += sr.num_tokens
            if req.status != RequestStatus.RUNNING or req.request_id not in live:
                continue  # finished or preempted since the step was launched: its blocks are free already
            # with drafts: the last token's row and the accepted drafts' (the rest computed rejected tokens)
            n = len(sampled.get(req.request_id, ())) if sr.spec_token_ids else sr.num_tokens
            tokens = req.all_token_ids
            assert sr.start + n <= len(tokens) - 1, "each computed position's next token is known"
            if n:
                rows.append((req, sr.start, n, hidden[start:start + n], sr.start + n == len(tokens) - 1))
        for rid, (token, state) in self._run(rows).items():
            self.first[rid] = (len(live[rid].all_token_ids), token, state)

    # -- drafting --------------------------------------------------------------------------------
    def propose_for(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to `limit` drafts for each (request, limit): the first from the last step's pass, each
        further one from a pass of the layer over the draft before it."""
        drafts: dict[str, list[int]] = {}
        chain = []
        for req, limit in wanted:
            first = self.first.get(req.request_id)
            # blocks for the drafts' positions and the verification after them, taken now
            if first is None or first[0] != len(req.all_token_ids) or not self.kv.allocate_slots(
                    req, limit, reserve=self.reserve):
                continue
            drafts[req.request_id] = [first[1]]
            if limit > 1:
                chain.append((req, limit, first[2]))
        while chain:
            # the newest draft at the position after the last known token's (the layer's input there)
            made = self._run([(req, len(req.all_token_ids) - 2 + len(drafts[req.request_id]), 1, state[None], True)
                              for req, _, state in chain], drafts)
            for req, _, _ in chain:
                drafts[req.request_id].append(made[req.request_id][0])
            chain = [(req, limit, made[req.request_id][1]) for req, limit, _ in chain
                     if len(drafts[req.request_id]) < limit]
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _run(self, rows: list[tuple], drafts: dict[str, list[int]] | None = None) -> dict[str, tuple]:
        """One pass of the layer over (request, first position, rows, the hidden states they read, whether
        the last row drafts): request id -> (its draft, the layer's output state at its last row) for
        those that draft. In chained passes a request's `drafts` follow its tokens as the layer's input."""
        if not rows:
            return {}
        rows.sort(key=lambda r: r[2] > self.DECODE_ROWS)  # decode rows first, as the runner wants them
        scheduled = []
        for req, start, n, _, samples in rows:
            sh = Request(req.request_id, [], _GREEDY)
            sh.status = RequestStatus.RUNNING
            # position q reads token q + 1
            sh.all_token_ids = req.all_token_ids[1:] + (drafts[req.request_id] if drafts is not None else [])
            sh.block_tables, sh.num_computed_tokens = req.block_tables, start
            scheduled.append(ScheduledRequest(sh, n, start, samples))
        self.model.previous_hidden = torch.cat([r[3] for r in rows])
        with torch.inference_mode():
            launched = self.runner.launch(SchedulerOutput(scheduled, sum(1 for r in rows if r[2] <= self.DECODE_ROWS)))
            out = self.runner.collect(launched)
        self.model.previous_hidden = None
        made, end = {}, 0
        for req, _, n, _, samples in rows:
            end += n
            if samples:
                made[req.request_id] = (out.sampled[req.request_id][0].token_id, launched.hidden[end - 1])
        return made
