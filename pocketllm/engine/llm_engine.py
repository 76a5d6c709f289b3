"""The engine: one step loop over the scheduler, the model runner and the output processor."""
from __future__ import annotations

import hashlib
import itertools
import logging
import numbers
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from pocketllm import hub
from pocketllm.config import EngineArgs
from pocketllm.core.request import Request, RequestStatus
from pocketllm.core.scheduler_output import SchedulerOutput
from pocketllm.distributed.parallel_state import TPGroup, tensor_parallel
from pocketllm.engine.detokenizer import StopStrings
from pocketllm.engine.kv_cache_manager import KVCacheManager
from pocketllm.engine.kv_plan import KVPlan, available_memory, size_text
from pocketllm.engine.output_processor import OutputProcessor, ParentState
from pocketllm.engine.scheduler import Scheduler, SchedulerConfig
from pocketllm.errors import ConfigurationError, EngineDeadError, RequestError
from pocketllm.hub import HubName
from pocketllm.loaders.model_source import ModelSource
from pocketllm.lora_request import LoRARequest
from pocketllm.outputs import RequestOutput
from pocketllm.pooling_params import PoolingParams
from pocketllm.runner.memory import weight_bytes
from pocketllm.runner.model_runner import LaunchedStep, ModelRunner
from pocketllm.runner.worker import TORCH_DTYPES, Worker
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured.backend import StructuredOutputs

log = logging.getLogger("pocketllm")
_POOLED = SamplingParams(max_tokens=1)  # the sampling settings of an embedding request: nothing is sampled


@dataclass
class StepStats:
    num_tokens: int = 0
    num_seqs: int = 0
    num_decodes: int = 0
    schedule_time: float = 0.0
    prepare_time: float = 0.0
    forward_time: float = 0.0
    total_time: float = 0.0
    # the GPU's time for the step whose results this call read back (this one, or with asynchronous
    # scheduling the one before), when the runner times steps (`ModelRunner.time_steps`)
    device_time: float | None = None

    @property
    def overhead_time(self) -> float:
        """Step time not spent in the model forward and sampler."""
        return self.total_time - self.forward_time


def _is_device_fault(error: BaseException) -> bool:
    """A CUDA fault leaves the device's context unusable: nothing after it can be trusted."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(error, accel)) or "CUDA error" in str(error)


CHILD_MARK = "#"  # the choices of request "x" run as sequences "x#0", "x#1", ...


def check_request_id(request_id) -> None:
    """A request id is a non-empty string that cannot be mistaken for one of a request's choices."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"a request id must be a non-empty string, got {request_id!r}")
    if CHILD_MARK in request_id:
        raise RequestError(f"request id {request_id!r} contains {CHILD_MARK!r}, which names a request's "
                           f"choices ({request_id.split(CHILD_MARK)[0]}{CHILD_MARK}0, ...); choose another")


def _wrap64(x: int) -> int:
    """x as a signed 64-bit integer (sibling seeds past the largest one wrap around)."""
    return (x + 2**63) % 2**64 - 2**63


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigurationError("device 'cuda' was asked for but no CUDA GPU is visible; "
                                 "use --device cpu (device='cpu' in Python)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, model_dtype: str) -> str:
    if dtype != "auto":
        return dtype
    if device.type == "cpu":
        return "float32"
    return "float16" if model_dtype == "float16" else "bfloat16"


def resolve_model(args: EngineArgs, device: torch.device) -> str:
    """Sets `args.model` to a local path: the default model pulled, or a hub name fetched (refused first if
    it cannot fit the GPU). Returns the name the server calls the model by default."""
    if args.model is None:
        from pocketllm.pull import pull_default_model

        args.model = str(pull_default_model())
    elif args.load_format != "dummy" and (name := HubName.parse(args.model)) is not None:
        fits = available_memory(device, args.gpu_memory_utilization) if device.type == "cuda" else None
        args.model = str(hub.resolve(name, max_bytes=fits))
        return str(name)
    return Path(args.model).name


def encoder_settings(args: EngineArgs, positions: int) -> None:
    """An encoder computes each prompt whole, in one step, and keeps no KV: nothing to share or chunk, and its
    blocks only count the tokens of one step's prompts."""
    args.enable_chunked_prefill = args.enable_prefix_caching = False
    args.max_num_batched_tokens = max(args.max_num_batched_tokens, min(args.max_model_len or positions, positions))
    args.num_kv_blocks = args.num_kv_blocks or -(-args.max_num_batched_tokens // args.block_size) + args.max_num_seqs


class LLMEngine:
    def __init__(self, args: EngineArgs):
        t_start = time.perf_counter()
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = resolve_device(args.device)
        self.model_name = resolve_model(args, self.device)  # (args.model: now a path, or a dummy's shape)
        self.source = ModelSource.open(args.model, args.load_format)
        path = self.source.path
        quant_types = self.source.quant_types
        cfg = self.model_config = self.source.config

        args.resolve_step_tokens(self.device.type)
        self.dtype_name = resolve_dtype(args.dtype, self.device, cfg.torch_dtype)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.block_size = args.block_size
        self.worker = Worker(self.source, args, self.device, self.dtype_name)  # checks the configuration
        self.kv_layout = self.runtime.kv_layout
        encoder = self.runtime.capabilities.encoder
        positions = self.runtime.model_class.max_positions(cfg)
        if encoder:
            encoder_settings(args, positions)
        self.kv_plan = KVPlan(args, self.kv_layout, self.block_size, self.device, positions)
        self.tokenizer = self.source.tokenizer(args.tokenizer)
        spec = args.speculative
        # embed: each request's prompt is pooled into one vector (the model's pooling; else an encoder's
        # first token's, a decoder's last token's)
        self.task = args.task if args.task != "auto" else "embed" if cfg.pooling or encoder else "generate"
        self.default_pooling = cfg.pooling or ("cls" if encoder else "last")
        if self.task == "embed" and spec is not None:
            raise ConfigurationError("speculative_config drafts generated tokens; task embed generates none")
        if spec is not None and spec.row_invariant and self.device.type != "cuda":
            raise ConfigurationError("speculative_config: row_invariant is for CUDA devices (cuBLAS's kernel "
                                     f"choice), not {self.device.type}")
        self.drafter = None
        if spec is not None and spec.method == "draft_model":  # checked against this model before any weight
            from pocketllm.speculative.draft_model import DraftModel

            self.drafter = DraftModel(spec, self)
        elif spec is not None and spec.method == "mtp":
            from pocketllm.speculative.mtp import MTPProposer

            self.drafter = MTPProposer(spec, self)
        # A block id holds its tokens' KV in every layer, a draft model's too (of this rank's KV heads).
        tp = args.tensor_parallel_size
        per_block = 0 if encoder else ModelRunner.kv_bytes_per_block(self.runtime.model_class.kv_shape(cfg),
                                                                     self.kv_layout, self.block_size, self.dtype,
                                                                     tp, args.kv_cache_dtype)
        self.kv_plan.bytes_per_block = per_block + (self.drafter.kv_bytes_per_block if self.drafter else 0)
        # What loading will take, checked before a weight is read (this rank's share on CUDA; the
        # ranks share the host's memory on the CPU).
        self.planned_weight_bytes = self.worker.planned_weight_bytes() + (
            self.drafter.planned_weight_bytes() if self.drafter else 0)
        share = self.planned_weight_bytes // tp if self.device.type == "cuda" else self.planned_weight_bytes
        self.kv_plan.plan_steps(cfg, 4 if self.device.type == "cpu" else torch.finfo(self.dtype).bits // 8,
                                graphs=not args.enforce_eager and self.runtime.capabilities.cuda_graphs)
        self.kv_plan.check_fits(share, path.name, mapped=self.source.is_gguf, experts=cfg.num_experts > 0,
                                quantized_kv="int8" in self.runtime.capabilities.kv_cache_dtypes)
        num_blocks = self.kv_plan.blocks_before_loading()  # None on CUDA: what the weights leave

        # Everything is checked: now read the weights (each tensor-parallel rank its shard, at the
        # same time). On CUDA max_model_len may still be lowered once the KV cache is sized; rotary
        # tables longer than needed are harmless.
        self.ranks = None
        group = TPGroup()
        if tp > 1:
            from pocketllm.runner.tp_ranks import RankProcesses

            self.ranks = RankProcesses(args, self.device.type, self.dtype_name, self.max_model_len)
            self._finalizer = weakref.finalize(self, self.ranks.shutdown)
            group = self.ranks.group
        try:
            with tensor_parallel(group):
                model, num_blocks = self._load(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = num_blocks
        salt = "|".join(map(str, (cfg.architecture, self.dtype_name, cfg.num_layers, cfg.num_kv_heads,
                                  cfg.head_dim, self.block_size, path.resolve(), sorted(quant_types))))
        self.kv = KVCacheManager(num_blocks, self.block_size, args.enable_prefix_caching,
                                 hashlib.sha256(salt.encode()).digest(), self.kv_layout.windows,
                                 lookahead=self.drafter is not None and self.drafter.kv_lookahead)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=self.max_model_len,
                            enable_chunked_prefill=args.enable_chunked_prefill,
                            max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes), self.kv,
            lora=self.lora)
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self.last_step = StepStats()
        # Launched and not yet read back (asynchronous scheduling): (its schedule, its launch).
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._step_scheds: list[SchedulerOutput] | None = []  # the running step's batches (failure scope)
        self._failed_steps = 0  # consecutive
        self._wait_time = 0.0
        self._device_time: float | None = None  # of the step read back in this call (StepStats)
        self.async_scheduling = (self.device.type == "cuda" if args.async_scheduling is None
                                 else args.async_scheduling)
        self.speculator = None
        if spec is not None:
            from pocketllm.speculative.ngram import NgramProposer
            from pocketllm.speculative.speculator import Speculator

            if self.drafter is not None:
                self.drafter.bind(num_blocks, self.kv, self.scheduler.reserve_blocks)
            proposer = self.drafter or NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                     spec.prompt_lookup_max)
            self.speculator = Speculator(proposer, spec.num_speculative_tokens, self.device.type == "cpu",
                                         self.async_scheduling)
        groups = f" ({self.kv_layout.describe()})" if self.kv_layout.is_hybrid else ""
        log.info("Loaded %s (%s; weights %s) on %s in %.1f s: %d KV blocks of %d tokens%s, context %d",
                 cfg.architecture, self._describe_weights(model, quant_types), size_text(self.weight_bytes),
                 self.device, time.perf_counter() - t_start, num_blocks, self.block_size, groups,
                 self.max_model_len)

    @property
    def runtime(self):
        """The model's runtime (its class, capabilities and KV layout), as the worker chose it."""
        return self.worker.runtime

    @property
    def max_model_len(self) -> int:
        """The longest request: the model's context, or what was asked for, lowered to what the KV
        cache holds when nothing was asked for."""
        return self.kv_plan.max_model_len

    # -- set-up helpers --------------------------------------------------------------------------
    def _load(self, num_blocks: int | None):
        """(the model, the KV cache's blocks): the weights read, the cache sized (CUDA: what the
        weights leave), the runner built; with tensor parallelism as rank 0, the others' shards in."""
        args, spec = self.args, self.args.speculative
        t0 = time.perf_counter()
        model = self.worker.load(self.max_model_len)
        self.weight_bytes = weight_bytes(model, self.device)  # before the runner binds the KV cache to it
        if self.drafter is not None:
            self.drafter.load()
            self.weight_bytes += weight_bytes(self.drafter.model, self.device)
        if self.ranks is not None:
            self.ranks.wait_loaded()
        # each sequence's drafts are decode rows of their own: the graphs hold them all
        max_decode_rows = args.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        # (the adapters' slots take memory before the KV cache is sized)
        self.lora = self.worker.lora_manager(max_rows=max(max_decode_rows, args.max_num_batched_tokens))
        self.load_time = time.perf_counter() - t0

        if num_blocks is None:
            num_blocks = self.kv_plan.blocks_after_loading()
        if self.ranks is not None:
            self.ranks.share_num_blocks(num_blocks)
        if spec is not None and spec.row_invariant:
            from pocketllm.layers.linear import use_row_invariant_gemms

            log.info("speculative decoding: %d projections on the row-invariant GEMM", use_row_invariant_gemms(model))
        self.runner = self.worker.build_runner(num_blocks, self.block_size, self.max_model_len,
                                               max_decode_rows=max_decode_rows,
                                               lora=self.lora)
        return model, num_blocks

    def on_ranks_lost(self, callback) -> None:
        """`callback(EngineDeadError)` runs on a watchdog thread as soon as a tensor-parallel rank
        ends while the engine runs: the engine's own thread may be blocked in a collective for good."""
        if self.ranks is not None:
            self.ranks.on_lost(lambda why: callback(EngineDeadError(why)))

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        if self.ranks is not None:
            self._finalizer()
            self.ranks = None

    def release(self) -> None:
        """Frees the weights and the KV cache for good (a multi-model server unloading this model): whatever
        still holds the engine holds none of its memory. The engine serves nothing after."""
        self.shutdown()
        self.runner = self.worker = self.drafter = self.speculator = self._inflight = self.lora = None
        self.kv = self.scheduler = self.source = None

    def _describe_weights(self, model: torch.nn.Module, quant_types: set[str]) -> str:
        """Where the weights came from and in what form they are held."""
        if self.source.dummy:
            return f"random weights, {self.dtype_name}"
        if not self.source.is_gguf:
            return f"safetensors, {self.dtype_name}"
        from pocketllm.quant.linear import GGUFLinear

        layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        kept = sorted({m.qtype.name for m in layers if m.path != "dense"})
        dense = sorted({m.qtype.name for m in layers if m.path == "dense"} - {"F32", "F16", "BF16"})
        parts = [f"GGUF {', '.join(kept)} kept quantized"] if kept else []
        if dense:
            parts.append(f"{', '.join(dense)} dequantized to {self.dtype_name}")
        return "; ".join(parts) or f"GGUF {', '.join(sorted(quant_types))}, {self.dtype_name}"

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    # -- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate_request(self, ids: list[int], params: SamplingParams | None = None) -> None:
        """Everything about a request that depends on the model, checked before it is queued:
        nothing a request carries may fail later inside a step (where the whole batch runs)."""
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_model_len="
                               f"{self.max_model_len}; shorten it or raise max_model_len")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not (isinstance(t, numbers.Integral) and 0 <= t < vocab)]  # numpy ints too
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        for param, values in (() if params is None else (("stop_token_ids", params.stop_token_ids),
                                                           ("logit_bias", params.logit_bias))):
            bad = [t for t in values if not 0 <= t < vocab]
            if bad:
                err = RequestError(f"{param} has token ids out of range [0, {vocab}): {bad[:5]}")
                err.param = param
                raise err

    def add_request(self, request_id: str | None, prompt: str | dict | list[int],
                    params: SamplingParams | PoolingParams | None = None, arrival_time: float | None = None,
                    grammar=None, lora_request: LoRARequest | str | None = None) -> str:
        """Queue a request; `prompt` is a text, token ids, or a dict of "prompt" and/or
        "prompt_token_ids" and an optional "cache_salt" (vLLM's: prefix-cache blocks are shared only
        between requests of the same salt). Its n choices share its prompt and parameters. With
        PoolingParams (task embed) its prompt is pooled into one vector (RequestOutput.embedding).
        `grammar`: its `structured_outputs` compiled already (the server's), else compiled here.
        `lora_request`: its LoRA adapter, by name (a LoRARequest with a path loads one not loaded yet)."""
        params = params or (PoolingParams() if self.task == "embed" else SamplingParams())
        request_id = str(next(self._ids)) if request_id is None else request_id
        check_request_id(request_id)
        if request_id in self.outputs.parents:
            raise RequestError(f"request id {request_id!r} is already in use")
        pooling = None
        if isinstance(params, PoolingParams) != (self.task == "embed"):
            serves, other, task = (("embeddings", "generation", "generate") if self.task == "embed"
                                   else ("generation", "embeddings", "embed"))
            raise RequestError(f"this model serves {serves} (task {self.task}); {other} need a model started "
                               f"with --task {task}")
        if isinstance(params, PoolingParams):  # one sequence, nothing sampled
            cfg = self.model_config
            pooling, params = params.resolved(self.default_pooling, cfg.normalize_embeddings, cfg.hidden_size), _POOLED
        text, ids = self.tokenize(prompt)
        self.validate_request(ids, params)
        lora_name, lora_id = self._lora_of(lora_request)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise RequestError(f"cache_salt must be a non-empty string, got {salt!r}")
        if grammar is None and params.structured_outputs:
            grammar = self.structured.compile(params.structured_outputs)
        stop = StopStrings(params.stop) if params.stop else None
        parent = ParentState(request_id, text, ids, prompt_logprobs=None if params.prompt_logprobs is None else [])
        leader = None
        for i in range(params.n):
            seed = None if params.seed is None or params.n == 1 else _wrap64(params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}{CHILD_MARK}{i}"
            req = Request(rid, ids, params, self.eos_token_ids, arrival_time, leader=leader, seed=seed,
                          cache_salt=salt, pooling=pooling)
            req.lora_name, req.lora_id = lora_name, lora_id
            if grammar is not None:  # each sibling walks the grammar on its own
                req.structured = self.structured.new_state(grammar)
            leader = leader or req
            parent.children.append(self.outputs.make_child(i, req, stop))
        self.outputs.add(parent)
        for c in parent.children:
            self.scheduler.add_request(c.request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self.outputs.parents.get(request_id)
        if parent is None:
            return None
        for c in parent.children:
            if not c.request.is_finished:
                self.scheduler.finish_request(c.request.request_id, RequestStatus.FINISHED_ABORTED)
        self.outputs.pop_finished(request_id)
        return parent.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.parents)

    def stale_requests(self, max_wait: float, now: float) -> list[str]:
        """Requests that have waited more than `max_wait` seconds since they arrived without
        being scheduled once (a preempted request has started: it is not stale)."""
        stale = []
        for req in self.scheduler.waiting:
            if req.first_scheduled_time is None and now - req.arrival_time > max_wait:
                parent = self.outputs.parent_of[req.request_id]
                if all(c.request.first_scheduled_time is None for c in parent.children):
                    stale.append(parent.request_id)
        return list(dict.fromkeys(stale))

    # -- the step ----------------------------------------------------------------------------------
    MAX_FAILED_STEPS = 3  # consecutive failed steps after which the engine gives up (EngineDeadError)

    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, then returns the outputs of the step that completes:
        this one, or with asynchronous scheduling the one before it (whose tokens are read
        back and processed while this one runs on the device). `last_step` describes the
        step launched here; with asynchronous scheduling its time includes waiting for the
        step before.

        A step that raises fails only the requests it carried: they come back finished with
        `error` set, their KV blocks freed, and the engine goes on. Only an error the engine
        cannot recover from (a CUDA fault, or several failed steps in a row) raises, as
        EngineDeadError."""
        self._step_scheds = []
        try:
            outs = self._step()
        except Exception as e:  # noqa: BLE001  (isolated below, or fatal)
            return self._fail_step(e)
        self._failed_steps = 0
        return outs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._wait_time = 0.0
        self._device_time = None
        outs: list[RequestOutput] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._step_scheds.append(inflight[0])
        # Drafts are proposed from the tokens just sampled: a step that speculates reads the one
        # before back first, and gives up the overlap with it.
        speculate = self.speculator is not None and self.speculator.wants_drafts()
        if inflight is not None and (speculate or any(r.needs_host_tokens for r in self.scheduler.requests.values())):
            outs, inflight = self._complete(*inflight, propose=speculate), None  # its tokens are needed on the host
        self._step_scheds = None  # a scheduler failure involves every running request
        sched = self.scheduler.schedule()
        self._step_scheds = [sched] + ([inflight[0]] if inflight is not None else [])
        t1 = time.perf_counter()
        launched = None if sched.is_empty else self.runner.launch(sched, inflight[1] if inflight else None)
        if inflight is not None:
            outs = self._complete(*inflight)
        if launched is not None:
            if self.async_scheduling:
                self._inflight = (sched, launched)
            else:
                outs = self._complete(sched, launched, propose=True)
        self.last_step = StepStats(sched.total_tokens, len(sched.scheduled), sched.num_decodes, t1 - t0,
                                   launched.prepare_time if launched else 0.0,
                                   (launched.launch_time if launched else 0.0) + self._wait_time,
                                   time.perf_counter() - t0, self._device_time)
        return outs

    def _complete(self, sched: SchedulerOutput, launched: LaunchedStep, propose: bool = False) -> list[RequestOutput]:
        """Reads a launched step's tokens back and turns them into request outputs; with `propose`
        (the next step is not scheduled yet), drafts for it too."""
        t0 = time.perf_counter()
        result = self.runner.collect(launched)
        self._wait_time += time.perf_counter() - t0
        self._device_time = result.device_time
        parents: dict[str, ParentState] = {}
        for rid, error in result.failed.items():  # sampling failed for these rows alone
            parents.update(self._fail_requests([rid], error))
        for rid, (first, scored) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and first <= req.num_prompt_scored:  # a recomputation scores some again
                new = scored[req.num_prompt_scored - first:]
                req.num_prompt_scored += len(new)
                self.outputs.add_prompt_logprobs(req, new)
        for rid, vector in result.pooled.items():
            if (req := self.scheduler.requests.get(rid)) is not None:
                req.embedding = vector
        sampled = {rid: [tok.token_id for tok in toks] for rid, toks in result.sampled.items()}

        def on_token(req: Request, i: int) -> None:
            try:
                stop = self.outputs.process(req, result.sampled[req.request_id][i])
            except Exception as e:  # noqa: BLE001  (detokenizing or stop strings: this request alone)
                parents.update(self._fail_requests([req.request_id], e))
                return
            if stop is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

        touched = self.scheduler.update_from_output(sched, sampled, on_token)
        if self.speculator is not None:
            self.speculator.step_done(sched, result.sampled, self.scheduler.has_work(), result.hidden)
        now = time.monotonic()
        for req in touched:
            if req.first_token_time is None:
                req.first_token_time = now
            parent = self.outputs.parent_of.get(req.request_id)
            if parent is not None:
                parents[parent.request_id] = parent
        if propose and self.speculator is not None:
            self.speculator.propose(touched)
        return self._emit(parents)

    def _lora_of(self, lora_request: LoRARequest | str | None) -> tuple[str | None, int]:
        """(adapter name, the identity of its load) of a request, or (None, 0)."""
        if lora_request is None:
            return None, 0
        if self.lora is None:
            raise RequestError("this engine runs no LoRA adapters: start it with enable_lora (--enable-lora)")
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        if not isinstance(lora_request, str) and lora_request.lora_path and name not in self.lora.names():
            self.lora.load(name, lora_request.lora_path)
        return name, self.lora.identity(name)

    def _emit(self, parents: dict[str, ParentState]) -> list[RequestOutput]:
        """The outputs of these requests; the finished ones leave the engine."""
        outs = []
        for parent in parents.values():
            outs.append(parent.output())
            self.outputs.pop_finished(parent.request_id)
        return outs

    # -- failures ------------------------------------------------------------------------------------
    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """A step raised: fail the requests it carried (every running one if scheduling itself
        failed) and drop the step in flight; the rest of the engine's state is untouched."""
        self._failed_steps += 1
        if self.runner.ranks_mid_step:  # the other tensor-parallel ranks are inside that step for good
            self.ranks.out_of_step = True
            if (lost := self.ranks.lost(wait=2.0)) is not None:  # a rank's end broke the step's collectives
                raise EngineDeadError(lost) from error
            raise EngineDeadError(f"a tensor-parallel step failed after its ranks began it: {type(error).__name__}: "
                                  f"{error}") from error
        if _is_device_fault(error) or self._failed_steps >= self.MAX_FAILED_STEPS:
            raise EngineDeadError(f"the engine cannot go on after: {type(error).__name__}: {error}") from error
        log.error("a step failed; failing the requests it carried", exc_info=error)
        self._inflight = None
        if self._step_scheds is None:
            involved = [r.request_id for r in self.scheduler.running]
        else:
            involved = [sr.request.request_id for s in self._step_scheds for sr in s.scheduled]
        try:
            return self._emit(self._fail_requests(involved, error))
        except Exception as e:  # noqa: BLE001
            raise EngineDeadError(f"the engine could not recover from a failed step: {e}") from error

    def _fail_requests(self, child_ids: list[str], error: BaseException) -> dict[str, ParentState]:
        """Finish the parents of these sequences with an error. KV blocks only they hold are
        dropped from the prefix cache, since a failed step may not have written them."""
        parents: dict[str, ParentState] = {}
        for rid in child_ids:
            parent = self.outputs.parent_of.get(rid)
            if parent is None or parent.request_id in parents:
                continue
            parents[parent.request_id] = parent
            parent.error = f"{type(error).__name__}: {error}"
            for c in parent.children:
                req = c.request
                if not req.is_finished:
                    self.kv.forget_exclusive_blocks(req)
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
        return parents

    # -- introspection -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def check_no_leaks(self) -> None:
        """With no request alive, every KV block must be free again."""
        assert not self.scheduler.has_work(), self.scheduler.requests
        self.kv.pool.check_integrity()
        assert self.kv.num_free_blocks == self.num_blocks, (self.kv.num_free_blocks, self.num_blocks)
