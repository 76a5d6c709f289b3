"""`/v1/chat/completions`: messages rendered by the chat template, replies parsed for tool calls and
reasoning, constrained by the request's format or its forced tool calls."""
from __future__ import annotations

from fastapi import Request

from pocketllm.outputs import CompletionOutput, RequestOutput
from pocketllm.server import protocol as P
from pocketllm.server.serving import ChoiceProgress, Endpoint, Job, NewOutput, Prepared
from pocketllm.structured.chat import ReplyParser, tool_constraint
from pocketllm.structured.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser


class ChatCompletions(Endpoint):
    request_model = P.ChatCompletionRequest
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    async def prepare(self, request: Request, req: P.ChatCompletionRequest) -> Prepared:
        serving, reasoning = self.serving, self.serving.reasoning
        tools = serving.tools_of(req)
        prompts = [await serving.chat_prompt(req.messages, tools, req.chat_template_kwargs)]
        parser = self.reply_tool_parser(req, tools)
        opened = reasoning.prompt_state(prompts[0][0]) if reasoning else None
        constraint, where = self.constraint(req, tools, parser, opened)
        # Reply parsers whose markers are special tokens read them in the text.
        readers = [p for p in (parser, reasoning) if p is not None]
        params = serving.params(req, prompts, where="messages", max_tokens=req.max_new_tokens,
                                logprobs=req.num_logprobs, constraint=constraint, constraint_param=where,
                                skip_special_tokens=not any(p.needs_special_tokens for p in readers))
        replies = [ReplyParser(reasoning, opened, parser) for _ in range(req.n)] if readers else None
        return Prepared(prompts, params, where, replies)

    def reply_tool_parser(self, req: P.ChatCompletionRequest, tools: list[dict] | None) -> ToolParser | None:
        """The parser that finds calls in the replies: none when calls are off."""
        choice = req.effective_tool_choice
        if not tools or choice == "none":
            return None
        parser = self.serving.tool_parser_for(self.serving.chat_template_for(tools))
        if parser is None and choice == "auto":
            raise P.APIError(400, "\"auto\" tool choice needs a tool-call parser: start the server with "
                                  f"--tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}).", param="tool_choice",
                             code="invalid_value")
        return (parser or get_tool_parser("hermes")).for_tools(tools)  # forced calls: the grammar fixes the syntax

    def constraint(self, req: P.ChatCompletionRequest, tools: list[dict] | None, parser: ToolParser | None,
                   opened: bool | None) -> tuple[dict | None, str]:
        """`structured_outputs` for the request, and the parameter its errors belong to."""
        constraint, param = req.output_constraint()
        if parser is not None:
            forced = tool_constraint(tools, req.effective_tool_choice, req.parallel_tool_calls, parser)
            if forced is not None:
                constraint, param = forced, "tools"
        reasoning = self.serving.reasoning
        if constraint is not None and reasoning is not None:
            prefix = reasoning.grammar_prefix(opened, calls="tool_calls" in constraint)
            if prefix is not None:
                constraint = {**constraint, "reasoning": prefix}
        return constraint, param

    def choice(self, job: Job, index: int, i: int, c: CompletionOutput) -> dict:
        logprobs = P.chat_logprobs(c.logprobs, job.req.num_logprobs) if c.logprobs is not None else None
        message, finish = {"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason
        if job.replies is not None:
            message, finish = job.replies[index].message(c.text, c.finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def opening(self, job: Job) -> list[dict]:
        return [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(job.req.n * len(job.prompts))]

    def deltas(self, job: Job, k: int, i: int, out: RequestOutput, c: CompletionOutput,
               progress: ChoiceProgress, new: NewOutput) -> list[dict]:
        reply = job.replies[k] if job.replies is not None else None
        if reply is None:
            deltas = [{"content": new.text}] if new.text or new.entries or new.new_ids else []
        else:
            deltas = reply.deltas(c.text, c.finish_reason is not None) or ([{}] if new.entries or new.new_ids else [])
        lp = P.chat_logprobs(new.entries, job.req.num_logprobs) if c.logprobs is not None else None
        choices = [{"index": k, "delta": delta, "logprobs": None if j else lp, "finish_reason": None,
                    **({} if j else new.ids)} for j, delta in enumerate(deltas)]
        if c.finish_reason is not None:
            finish = c.finish_reason
            if reply is not None and reply.called and finish == "stop":
                finish = "tool_calls"
            choices.append({"index": k, "delta": {}, "logprobs": None, "finish_reason": finish})
        return choices
