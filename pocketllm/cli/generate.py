"""`pocketllm generate "PROMPT"`: print a completion of the prompt (with --chat: a chat reply to it)."""
from __future__ import annotations

import argparse
import dataclasses

from pocketllm.cli.args import add_engine_args, engine_args_from
from pocketllm.cli.chat import add_sampling_arguments, render, sampling_params_from, say_if_cut, stream_text
from pocketllm.cli.serve import load_engine, read_chat_template
from pocketllm.errors import ConfigurationError, RequestError
from pocketllm.tokenizer import has_chat_template


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_args(parser)  # [MODEL] first, as `serve` and `chat` take it
    parser.add_argument("prompt", help="the text to complete")
    add_sampling_arguments(parser)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message of a chat")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's (with --chat)")


def run(args: argparse.Namespace) -> int:
    # Checked before the model loads.
    chat_template = read_chat_template(args.chat_template)
    params = sampling_params_from(args)
    source = args.tokenizer or args.model
    if args.chat and chat_template is None and source is not None and has_chat_template(source) is False:
        raise ConfigurationError(f"{source} has no chat template (a base model?): leave out --chat to complete the "
                                 "prompt as it is, or give a template with --chat-template FILE")
    engine = load_engine(engine_args_from(args))
    if engine.tokenizer is None:
        raise ConfigurationError("this model has no tokenizer; it cannot take a text prompt")
    if args.chat:
        ids = render(engine, [{"role": "user", "content": args.prompt}], chat_template)
    else:
        ids = engine.tokenizer.encode(args.prompt)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model's context holds {engine.max_model_len}")
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    finish = None
    for delta, finish in stream_text(engine, ids, params):
        print(delta, end="", flush=True)
    print()
    say_if_cut(finish, params)
    return 0
