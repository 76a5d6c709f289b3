"""`/v1/completions` (legacy completions): text or token-id prompts, several in one request, with
`echo` and logprobs of the prompt's tokens as evaluation harnesses use them."""
from __future__ import annotations

from fastapi import Request

from pocketllm.outputs import CompletionOutput, RequestOutput
from pocketllm.server import protocol as P
from pocketllm.server.serving import ChoiceProgress, Endpoint, Job, NewOutput, Prepared


class Completions(Endpoint):
    request_model = P.CompletionRequest
    id_prefix = "cmpl-"
    object_name = chunk_object_name = "text_completion"

    async def prepare(self, request: Request, req: P.CompletionRequest) -> Prepared:
        serving = self.serving
        prompts = []
        for p in req.prompt_list():
            if isinstance(p, str):
                serving.check_prompt_size(p, "prompt")
                prompts.append((p, await serving.off_loop_if_large(len(p), serving.tokenizer().encode, p)))
            else:  # token ids: decoded for echo only once validated (below)
                prompts.append((None, list(p)))
        constraint, where = req.output_constraint()
        # echo with logprobs: the prompt's tokens get logprobs too (legacy completions, as OpenAI's)
        params = serving.params(req, prompts, where="prompt", max_tokens=req.max_tokens, logprobs=req.logprobs,
                                prompt_logprobs=req.logprobs if req.echo else None, constraint=constraint,
                                constraint_param=where)
        tok = serving.engine.tokenizer
        if req.echo and tok is not None:  # token-id prompts with their text, decoded from validated ids
            prompts = [(tok.decode(ids) if text is None else text, ids) for text, ids in prompts]
        return Prepared(prompts, params, where)

    def first_token(self, job: Job, i: int) -> str:
        """The text of prompt i's first token (an echoed prompt's first logprob entry)."""
        ids = job.prompts[i][1]
        tok = self.serving.engine.tokenizer
        return tok.decode(ids[:1]) if ids and tok is not None else ""

    def choice(self, job: Job, index: int, i: int, c: CompletionOutput) -> dict:
        prefix = (job.prompts[i][0] or "") if job.req.echo else ""
        entries = c.logprobs
        if entries is not None and job.req.echo:
            entries = job.last[i].prompt_logprobs + entries
        logprobs = P.completion_logprobs(entries, 0, self.first_token(job, i)) if entries is not None else None
        return {"text": prefix + c.text, "index": index, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def progress(self, job: Job, i: int) -> ChoiceProgress:
        echo = (job.prompts[i][0] or "") if job.req.echo else ""
        return ChoiceProgress(echo=echo, offset=len(echo))

    def deltas(self, job: Job, k: int, i: int, out: RequestOutput, c: CompletionOutput,
               progress: ChoiceProgress, new: NewOutput) -> list[dict]:
        if not (new.text or new.entries or new.new_ids or c.finish_reason is not None):
            return []
        lp = None
        if c.logprobs is not None and progress.echo:  # the first chunk: the echoed prompt's too
            lp = P.completion_logprobs(out.prompt_logprobs + new.entries, 0, self.first_token(job, i))
        elif c.logprobs is not None:
            lp = P.completion_logprobs(new.entries, progress.offset + new.start)
        choice = {"text": progress.echo + new.text, "index": k, "logprobs": lp, "finish_reason": c.finish_reason,
                  **new.ids}
        progress.echo = ""
        return [choice]
