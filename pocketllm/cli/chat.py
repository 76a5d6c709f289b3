"""`pocketllm chat [MODEL]`: chat in the terminal, replies streamed as they are generated.
The conversation is kept; the oldest turns are dropped when it outgrows the context."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pocketllm.cli.args import add_engine_args, engine_args_from
from pocketllm.cli.serve import load_engine, read_chat_template
from pocketllm.errors import ConfigurationError
from pocketllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine imports torch: only when a command runs it
    from pocketllm.engine.llm_engine import LLMEngine


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_args(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature; 0 is greedy (default: 0.7)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens this likely (default: 1.0, all)")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)


def stream_text(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[str, str | None]]:
    """(text delta, finish reason once finished) of one request; closing the iterator early aborts it."""
    request_id = engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                text, finish = out.outputs[0].text, out.outputs[0].finish_reason
                if text[sent:] or finish:
                    yield text[sent:], finish
                    sent = len(text)
    finally:
        engine.abort_request(request_id)


def say_if_cut(finish: str | None, params: SamplingParams) -> None:
    """A reply cut by the token limit says so (on stderr), not only by stopping."""
    if finish == "length":
        print(f"[stopped at {params.max_tokens} tokens: --max-tokens or the context]", file=sys.stderr, flush=True)


def render(engine: LLMEngine, messages: list[dict], chat_template: str | None) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    # Checked before the model loads.
    chat_template = read_chat_template(args.chat_template)
    base_params = sampling_params_from(args)
    engine = load_engine(engine_args_from(args))
    if engine.tokenizer is None:
        raise ConfigurationError("this model has no tokenizer, so it cannot chat")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print("Type a message; /exit or Ctrl+D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = render(engine, system + history, chat_template)
        # Keep the newest turns that leave room for a reply.
        while len(ids) + 1 > engine.max_model_len and len(history) > 1:
            history = history[2:]  # the oldest exchange
            ids = render(engine, system + history, chat_template)
        room = engine.max_model_len - len(ids)
        if room < 1:
            print("error: the message is too long for the model's context", file=sys.stderr)
            history.pop()
            continue
        params = dataclasses.replace(base_params, max_tokens=min(base_params.max_tokens, room))
        reply, finish = "", None
        try:
            for delta, finish in stream_text(engine, ids, params):
                reply += delta
                print(delta, end="", flush=True)
        except KeyboardInterrupt:  # stops this reply, keeps the conversation
            pass
        print()
        say_if_cut(finish, params)
        history.append({"role": "assistant", "content": reply})
