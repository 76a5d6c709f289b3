"""What the generating endpoints share: one `OpenAIServing` (the model's tokenizer and template,
request limits, sampling parameters, grammars, the preparation thread) and the `Endpoint` pipeline
that turns a parsed request into engine requests and answers with a reply or a stream. Each
endpoint family (`chat`, `completions`) fills in its prompts, its choices and its stream deltas; another
protocol's endpoint (Anthropic's, Ollama's, OpenAI's Responses) subclasses one and translates the body
(`parse`), the reply (`reply`) and the stream's events (`stream_writer`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pocketllm.errors import PocketLLMError, RequestError, RequestFailedError
from pocketllm.outputs import CompletionOutput, RequestOutput
from pocketllm.sampling_params import SamplingParams
from pocketllm.server import protocol as P
from pocketllm.server.async_llm import AsyncLLM, EngineUnavailableError, RequestStream
from pocketllm.server.body_limits import SCREENED_BYTES, BodyLimits, refusal
from pocketllm.server.config import ServerConfig
from pocketllm.server.metrics import RequestTimer, ServerMetrics
from pocketllm.server.responses import INTERNAL_ERROR, SSEResponse, to_json
from pocketllm.structured.chat import ReplyParser, template_messages, template_tools
from pocketllm.structured.reasoning import get_reasoning_parser, infer_reasoning_parser
from pocketllm.structured.tool_parsers import ToolParser, get_tool_parser, infer_tool_parser
from pocketllm.structured.worker import HELPER_NICENESS, GrammarBusyError, GrammarCompilerFailedError, GrammarWorkers
from pocketllm.tokenizer.chat_template import TemplateOutputTooLongError, render_limits

log = logging.getLogger("pocketllm")


async def merge_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:  # the common case: no task per output
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Job:
    """One API request: its engine requests (one per prompt), their timers and outputs."""
    id: str
    req: P.ChatCompletionRequest | P.CompletionRequest | None  # (None: an embeddings request)
    prompts: list[tuple[str | None, list[int]]]
    streams: list[RequestStream] = field(default_factory=list)
    timers: list[RequestTimer] = field(default_factory=list)
    last: list[RequestOutput | None] = field(default_factory=list)
    replies: list[ReplyParser] | None = None  # per choice, when tools or reasoning shape chat replies
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = ""  # the model its replies name: the served model, or the LoRA adapter it asked for

    def close(self) -> None:
        for stream, timer, out in zip(self.streams, self.timers, self.last):
            stream.close()
            timer.finish(out, aborted=out is None or not out.finished)

    def record(self, i: int, out: RequestOutput) -> None:
        self.last[i] = out
        if out.finished:
            self.timers[i].finish(out)

    def usage(self) -> dict:
        outs = [o for o in self.last if o is not None]
        return P.usage(sum(len(p[1]) for p in self.prompts),
                       sum(len(c.token_ids) for o in outs for c in o.outputs),
                       sum(o.num_cached_tokens for o in outs))


async def unless_client_leaves(request: Request, coro) -> asyncio.Future | None:
    """Runs coro to its end, or cancels it when the client disconnects first: its finished task,
    or None if the client left."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return None if work.cancelled() else work



class OpenAIServing:
    """What every generating endpoint shares, one per server."""

    def __init__(self, llm: AsyncLLM, cfg: ServerConfig, metrics: ServerMetrics):
        self.llm, self.cfg, self.metrics = llm, cfg, metrics
        self.engine = llm.engine
        if cfg.tool_call_parser is not None:
            get_tool_parser(cfg.tool_call_parser)  # an unknown name fails at start-up
        model_template = self.engine.tokenizer.chat_template if self.engine.tokenizer is not None else None
        if self.engine.tokenizer is not None and not (cfg.chat_template or model_template):
            log.warning("%s has no chat template (a base model?): /v1/chat/completions will answer 400; send "
                        "prompts to /v1/completions, or give a template with --chat-template FILE", cfg.model_name)
        reasoning = cfg.reasoning_parser or infer_reasoning_parser(cfg.chat_template or model_template)
        self.reasoning = get_reasoning_parser(reasoning) if reasoning else None
        # One thread prepares the large requests (parse, render, tokenize), one after the other:
        # their work holds the interpreter lock in stretches, and each thread more doing so slows
        # the engine thread's steps again, and holds one more large request's memory.
        self._prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pocketllm-prep")
        self._screen: concurrent.futures.ProcessPoolExecutor | None = None  # started by the first huge body

    def close(self) -> None:
        """Stop the helpers: the grammar compiler and body-checking processes (if started) and the preparation thread."""
        if "_grammars" in self.__dict__:
            self._grammars.close()
        self._prep.shutdown(wait=False, cancel_futures=True)
        if self._screen is not None:
            self._screen.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args, **kwargs))

    # -- building a job --------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model itself); 404 for any other name."""
        if name is None or name == self.cfg.model_name:
            return None
        adapters = self.lora_adapters()
        if name in adapters:
            return name
        served = ", ".join(f"`{n}`" for n in [self.cfg.model_name, *adapters])
        raise P.APIError(404, f"The model `{name}` does not exist or you do not have access to it; "
                              f"this server serves {served}.", param="model", code="model_not_found")

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded (requests name them as their model)."""
        return self.engine.lora.names() if self.engine.lora is not None else []

    def check_request_size(self, req: P.ChatCompletionRequest | P.CompletionRequest) -> None:
        """Refuse, before any work, what would make each step costly for everyone: too many stop
        strings, stop token ids or bias entries, or more sequences (n x prompts) than the queue holds."""
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        prompts = len(req.prompt_list()) if isinstance(req, P.CompletionRequest) else 1
        self.limits.check_counts(len(stops), len(req.stop_token_ids or []), len(req.logit_bias or {}), req.n,
                                 prompts)

    @functools.cached_property
    def limits(self) -> BodyLimits:
        cfg = self.cfg
        return BodyLimits(cfg.max_stop_strings, cfg.max_stop_token_ids, cfg.max_logit_bias, cfg.max_messages,
                          cfg.max_tools, self.llm.max_queued_requests, self.engine.max_model_len)

    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise P.APIError(400, "This model has no tokenizer: send token ids to /v1/completions.",
                             param="prompt", code="invalid_value")
        return self.engine.tokenizer

    def chat_template_for(self, tools: list[dict] | None) -> str | None:
        tok = self.tokenizer()
        return self.cfg.chat_template or (tools and tok.chat_templates.get("tool_use")) or tok.chat_template

    def tool_parser_for(self, template: str | None) -> ToolParser | None:
        name = self.cfg.tool_call_parser or infer_tool_parser(template)
        return get_tool_parser(name) if name else None

    _RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")

    def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        template = self.chat_template_for(tools)
        dicts = [m.as_template_dict() for m in messages]
        reserved = [k for k in self._RESERVED_TEMPLATE_KWARGS if k in (template_kwargs or {})]
        if reserved:
            raise P.APIError(400, f"Invalid 'chat_template_kwargs': {reserved} are set by the request itself.",
                             param="chat_template_kwargs", code="invalid_value")
        if template is None:
            raise P.APIError(400, "This model has no chat template (a base model?): send a prompt to "
                                  "/v1/completions, or start the server with --chat-template FILE.",
                             param="messages", code="invalid_value")
        try:
            parser = self.tool_parser_for(template) or get_tool_parser("hermes")
            dicts = template_messages(dicts, tools, template, parser)
            tools = template_tools(tools, template)
            # A longer text than max_chars cannot fit the context; the template is also bounded in time.
            with render_limits(max_chars=self._max_prompt_chars):
                return self.tokenizer().apply_chat_template(
                    dicts, tools=tools, add_generation_prompt=add_generation_prompt, chat_template=template,
                    **(template_kwargs or {}))
        except P.APIError:
            raise
        except TemplateOutputTooLongError:  # at least max_model_len + 1 tokens: _check_tokens raises
            self._check_tokens(self._max_prompt_chars // (2 * self.tokenizer().max_token_chars), "messages",
                               f"rendered to more than {self._max_prompt_chars} characters")
            raise
        except Exception as e:  # noqa: BLE001  (a template raises what it likes: raise_exception, overflows, recursion)
            message = str(e) if isinstance(e, (jinja2.TemplateError, PocketLLMError)) else f"{type(e).__name__}: {e}"
            raise P.APIError(400, f"The chat template could not render the messages: {message}", param="messages",
                             code="invalid_value") from None

    @staticmethod
    def tools_of(req) -> list[dict] | None:
        """The request's tools as the chat template takes them (chat and tokenize requests)."""
        tools = getattr(req, "tools", None)
        return [t.model_dump(exclude_none=True) for t in tools] if tools else None

    # Tokenizing or rendering more text than this runs on a worker thread, not on the event loop.
    _OFF_LOOP_CHARS = 16384

    async def off_loop_if_large(self, num_chars: int, fn, *args, **kwargs):
        """fn(*args, **kwargs), on a worker thread when it works on more than _OFF_LOOP_CHARS."""
        if num_chars > self._OFF_LOOP_CHARS:
            return await self._prepare(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def parsed(self, model: type, body: bytes):
        """The request, validated on a worker thread when the body is large, after its counts are
        checked on its plain JSON: in a helper process for the largest bodies (body_limits)."""
        if len(body) <= self._OFF_LOOP_CHARS:
            return P.parse(model, body)
        if len(body) <= SCREENED_BYTES:
            return await self._prepare(self._parse_large, model, body)
        if self._screen is None:
            self._screen = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice, initargs=(HELPER_NICENESS,))
        problem = await asyncio.get_running_loop().run_in_executor(self._screen, refusal, body, self.limits)
        if problem is not None:
            raise P.APIError(*problem)
        return await self._prepare(P.parse, model, body)

    def _parse_large(self, model: type, body: bytes):
        self.limits.check_body(body)
        return P.parse(model, body)

    def _check_tokens(self, at_least: int, where: str, what: str) -> None:
        """Refuse what cannot fit the context, `at_least` tokens being a lower bound of its length."""
        if at_least > self.engine.max_model_len:
            raise P.APIError(400, f"This model's maximum context length is {self.engine.max_model_len} tokens. "
                                  f"However, your {where} {what}, which is at least {at_least} tokens. Please "
                                  f"reduce the length of the {where}.", param=where, code="context_length_exceeded")

    def check_text_size(self, num_chars: int, where: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: no token covers more
        than `max_token_chars` characters (halved again for normalizers that shrink text)."""
        at_least = num_chars // (2 * self.tokenizer().max_token_chars)
        self._check_tokens(at_least, where, f"{'have' if where == 'messages' else 'has'} {num_chars} characters")

    @functools.cached_property
    def _max_prompt_chars(self) -> int:
        """The longest text that may fit the context (see _check_text_size)."""
        return (self.engine.max_model_len + 1) * 2 * self.tokenizer().max_token_chars

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern | None:
        """The special tokens the tokenizer always splits out of a text, as one token each."""
        added = self.tokenizer()._backend.get_added_tokens_decoder().values()
        texts = {t.content for t in added if t.special and t.content and not t.single_word and not t.normalized}
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None

    def check_prompt_size(self, text: str, where: str, rendered: bool = False) -> None:
        """_check_text_size, counting each special token as the one token it is: a rendered chat of
        many short messages is mostly role markers (30,000 empty messages: 60,000 markers)."""
        if len(text) <= self.engine.max_model_len or self._special_tokens is None:  # (a token has a character at least)
            return self.check_text_size(len(text), where)
        markers = self._special_tokens.findall(text)
        rest = len(text) - sum(map(len, markers))
        self._check_tokens(len(markers) + rest // (2 * self.tokenizer().max_token_chars), where,
                           f"{'rendered to' if rendered else 'has'} {len(text)} characters with {len(markers)} "
                           "special tokens")

    async def chat_prompt(self, messages: list[P.ChatMessage], tools: list[dict] | None,
                           template_kwargs: dict | None = None,
                           add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        self.limits.check_chat_size(len(messages), len(tools or []))
        num_chars = sum(len(p) for m in messages for p in m.texts())
        # Each message costs at least a token in any template (its role's marker).
        self._check_tokens(max(num_chars // (2 * self.tokenizer().max_token_chars), len(messages)), "messages",
                           f"({len(messages)} of them) have {num_chars} characters")
        # Always on a worker thread: a template is the model file's code, and may run for its whole time limit.
        text = await self._prepare(self.render_chat, messages, add_generation_prompt, tools, template_kwargs)
        self.check_prompt_size(text, "messages", rendered=True)
        # The template writes the special tokens it wants (BOS included).
        return text, await self.off_loop_if_large(len(text), self.tokenizer().encode, text, add_special_tokens=False)

    def params(self, req, prompts: list[tuple[str | None, list[int]]], *, where: str, max_tokens: int | None,
               logprobs: int | None, prompt_logprobs: int | None = None, constraint: dict | None = None,
               constraint_param: str | None = None, skip_special_tokens: bool = True) -> SamplingParams:
        """The request's sampling parameters, its reply bounded by the context (`where` names the
        field of the prompt; `max_tokens` None: the server's default bound)."""
        if self.engine.task == "embed":
            raise P.APIError(400, f"The model `{self.cfg.model_name}` is an embedding model (task embed): it "
                                  "generates no text; ask /v1/embeddings (or Ollama's /api/embed).",
                             param="model", code="model_not_supported")
        limit = self.engine.max_model_len
        longest = max(len(ids) for _, ids in prompts)
        if max_tokens is None:  # bounded by default, so that a model that loops does not run to the end of the context
            max_tokens = min(limit - longest, self.cfg.default_max_tokens or limit)
        if max_tokens < 1:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                  f"{where} resulted in {longest} tokens. Please reduce the length of the "
                                  f"{where}.", param=where, code="context_length_exceeded")
        if longest + max_tokens > limit:
            raise P.APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                  f"requested {longest + max_tokens} tokens ({longest} in the {where}, "
                                  f"{max_tokens} in the completion). Please reduce the length of the {where} "
                                  "or completion.", param=where, code="context_length_exceeded")
        params = req.sampling_params(max_tokens, logprobs, constraint, constraint_param, skip_special_tokens,
                                     prompt_logprobs=prompt_logprobs)
        for _, ids in prompts:
            try:
                self.engine.validate_request(ids, params)
            except RequestError as e:
                raise P.APIError(400, str(e), param=getattr(e, "param", None) or where,
                                 code="invalid_value") from None
        return params

    @functools.cached_property
    def _grammars(self) -> GrammarWorkers:
        return GrammarWorkers(self.engine.structured)

    async def grammar(self, request: Request, spec: dict, where: str):
        """The request's compiled grammar, handed to the engine with it (the engine thread never
        compiles for the server); None if the client left meanwhile, which stops the compilation."""
        compiled = self.engine.structured.cached(spec)
        if compiled is not None:
            return compiled
        work = await unless_client_leaves(request, self._grammars.compile(spec, self.cfg.max_grammar_compile_time))
        if work is None:
            return None
        try:
            return work.result()
        except RequestError as e:
            raise P.APIError(400, str(e), param=where, code="invalid_value") from None
        except GrammarBusyError as e:
            raise EngineUnavailableError(str(e), retry_after=1) from None
        except GrammarCompilerFailedError as e:
            log.error("%s", e)
            raise RequestFailedError(f"The server could not compile the request's grammar ({e}).") from None


@dataclass
class Prepared:
    """What an endpoint makes of a request before it is queued."""
    prompts: list[tuple[str | None, list[int]]]  # (text or None for token ids, token ids) per prompt
    params: SamplingParams
    where: str  # the parameter a grammar's errors belong to
    replies: list[ReplyParser] | None = None  # per choice, when tools or reasoning shape chat replies


@dataclass
class ChoiceProgress:
    """How much of one choice a stream has sent."""
    text: int = 0  # characters of its text
    tokens: int = 0  # its token ids
    ended: bool = False  # a finished choice stays in its request's later outputs
    echo: str = ""  # the echoed prompt, sent with the first delta (completions)
    offset: int = 0  # characters before the completion's text (its logprobs' offsets start after them)


@dataclass
class NewOutput:
    """What one output adds to a choice since the stream's last chunk."""
    start: int  # where `text` starts in the choice's text
    text: str
    entries: list  # the new tokens' logprob entries
    new_ids: list[int]  # the new token ids, when the request asked for them
    ids: dict  # the chunk's token-id fields (vLLM's return_token_ids)


class Endpoint:
    """One endpoint family's requests, from the parsed body to the reply or the stream. Subclasses
    give the request type, the id prefix and objects' names, and fill in `prepare`, `choice` and
    `deltas`."""
    request_model: type
    id_prefix: str  # of a reply's id, as the protocol writes them ("chatcmpl-", Anthropic's "msg_")
    object_name: str  # of the whole reply
    chunk_object_name: str  # of a streamed chunk

    def __init__(self, serving: OpenAIServing):
        self.serving, self.cfg = serving, serving.cfg

    async def parse(self, body: bytes):
        """The request a body holds (another protocol's endpoint translates its own)."""
        return await self.serving.parsed(self.request_model, body)

    async def prepare(self, request: Request, req) -> Prepared:
        raise NotImplementedError

    def choice(self, job: Job, index: int, i: int, c: CompletionOutput) -> dict:
        """Choice `index` of the whole reply (prompt i's output c)."""
        raise NotImplementedError

    def opening(self, job: Job) -> list[dict]:
        """A stream's first choices, before any output."""
        return []

    def deltas(self, job: Job, k: int, i: int, out: RequestOutput, c: CompletionOutput,
               progress: ChoiceProgress, new: NewOutput) -> list[dict]:
        """The streamed choices for what output c of prompt i adds to choice k."""
        raise NotImplementedError

    async def create(self, request: Request, body: bytes | None = None):
        """The reply to a request (its body read here, unless a route that looked at it first gives it)."""
        serving = self.serving
        req = await self.parse(await request.body() if body is None else body)
        lora = serving.check_model(req.model)
        serving.check_request_size(req)
        prep = await self.prepare(request, req)
        grammar = None
        if prep.params.structured_outputs:  # compiled here, so a bad one is a 400 before queueing
            grammar = await serving.grammar(request, prep.params.structured_outputs, prep.where)
            if grammar is None:
                return Response(status_code=499)  # the client left: nobody will read it
        job = Job(f"{self.id_prefix}{uuid.uuid4().hex}", req, prep.prompts, replies=prep.replies,
                  model=lora or self.cfg.model_name)
        arrival = request.state.arrival_time
        try:
            for i, (text, ids) in enumerate(prep.prompts):
                rid = job.id if len(prep.prompts) == 1 else f"{job.id}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids}
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                job.streams.append(serving.llm.add_request(rid, prompt, prep.params, arrival, grammar=grammar,
                                                           lora=lora))
                job.timers.append(serving.metrics.timer(arrival))
                job.last.append(None)
        except BaseException:
            job.close()
            raise
        if req.stream:
            writer = self.stream_writer(job)
            return SSEResponse(self.stream(job, writer), job.close, writer.media_type)
        try:
            return await self.complete(request, job)
        finally:
            job.close()

    async def complete(self, request: Request, job: Job) -> Response:
        async def collect():
            async for i, out in merge_outputs(job.streams):
                job.timers[i].tokens_sent(1)  # the first call is the TTFT; the count only feeds ITL
                job.record(i, out)

        work = await unless_client_leaves(request, collect())
        if work is None:
            return Response(status_code=499)  # nobody will read it
        work.result()
        choices = []
        # every choice in index order: (index, prompt position, output)
        for idx, i, c in [(i * job.req.n + c.index, i, c) for i, out in enumerate(job.last) for c in out.outputs]:
            choice = self.choice(job, idx, i, c)
            if job.req.return_token_ids:
                choice.update(prompt_token_ids=job.prompts[i][1], token_ids=c.token_ids)
            choices.append(choice)
        return JSONResponse(self.reply(job, choices))

    def reply(self, job: Job, choices: list[dict]) -> dict:
        """The whole reply, from its choices."""
        return {"id": job.id, "object": self.object_name, "created": job.created, "model": job.model,
                "choices": choices, "usage": job.usage(), "system_fingerprint": None}

    def stream_writer(self, job: Job) -> OpenAIStream:
        """What a stream's chunks are written as (another protocol's endpoint writes its own events)."""
        return OpenAIStream(job, self.chunk_object_name, job.model)

    def progress(self, job: Job, i: int) -> ChoiceProgress:
        """A stream's record of one choice of prompt i, before anything is sent."""
        return ChoiceProgress()

    async def stream(self, job: Job, writer) -> AsyncIterator[str]:
        req = job.req
        n = req.n
        progress = [self.progress(job, k // n) for k in range(n * len(job.prompts))]
        try:
            for e in writer.start():
                yield e
            for choice in self.opening(job):
                for e in writer.choice(choice):
                    yield e
            async for i, out in merge_outputs(job.streams):
                events, new_tokens = [], 0
                for c in out.outputs:
                    k = i * n + c.index
                    p = progress[k]
                    if p.ended:
                        continue
                    p.ended = c.finish_reason is not None
                    # vLLM's extension: each chunk carries its new token ids (the first also the prompt's).
                    new_ids = c.token_ids[p.tokens:] if req.return_token_ids else []
                    ids = {"token_ids": new_ids} if req.return_token_ids else {}
                    if ids and p.tokens == 0:
                        ids["prompt_token_ids"] = job.prompts[i][1]
                    new = NewOutput(p.text, c.text[p.text:], (c.logprobs or [])[p.tokens:len(c.token_ids)], new_ids, ids)
                    new_tokens = max(new_tokens, len(c.token_ids) - p.tokens)
                    p.text, p.tokens = len(c.text), len(c.token_ids)
                    events += [e for choice in self.deltas(job, k, i, out, c, p, new) for e in writer.choice(choice)]
                job.timers[i].tokens_sent(new_tokens)
                job.record(i, out)
                for e in events:
                    yield e
            for e in writer.end():
                yield e
        except (EngineUnavailableError, RequestFailedError) as e:  # headers are sent: the error goes in the stream
            status = 503 if isinstance(e, EngineUnavailableError) else 500
            for event in writer.error(P.APIError(status, str(e), type="server_error")):
                yield event
        except Exception:
            log.exception("a streaming response failed")
            for event in writer.error(INTERNAL_ERROR):
                yield event


class OpenAIStream:
    """A stream's chunks as OpenAI's server-sent events: `data: {chunk}` each, `data: [DONE]` last."""
    media_type = "text/event-stream"

    def __init__(self, job: Job, object_name: str, model: str):
        self.job = job
        self.base = {"id": job.id, "object": object_name, "created": job.created, "model": model,
                     "system_fingerprint": None}
        # As OpenAI: with include_usage every chunk has a usage, null until the last one.
        self.usage = {"usage": None} if job.req.include_usage else {}

    def start(self) -> list[str]:
        return []

    def choice(self, choice: dict) -> list[str]:
        return [f"data: {to_json({**self.base, 'choices': [choice], **self.usage})}\n\n"]

    def end(self) -> list[str]:
        last = [f"data: {to_json({**self.base, 'choices': [], 'usage': self.job.usage()})}\n\n"] if self.usage else []
        return last + ["data: [DONE]\n\n"]

    def error(self, e: P.APIError) -> list[str]:
        return [f"data: {to_json(e.body())}\n\n", "data: [DONE]\n\n"]
