"""`pocketllm generate "PROMPT"`: print a completion of the prompt (with --chat: a chat reply to it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pocketllm.cli.args import add_engine_args
from pocketllm.cli.chat import add_sampling_arguments, render, stream_text
from pocketllm.cli.serve import load_engine
from pocketllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("prompt", help="the text to complete")
    add_engine_args(parser, positional_model=False)
    add_sampling_arguments(parser)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message of a chat")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's (with --chat)")


def run(args: argparse.Namespace) -> int:
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    engine = load_engine(args)
    if engine.tokenizer is None:
        print("error: this model has no tokenizer; it cannot take a text prompt", file=sys.stderr)
        return 2
    if args.chat:
        ids = render(engine, [{"role": "user", "content": args.prompt}], chat_template)
    else:
        ids = engine.tokenizer.encode(args.prompt)
    room = engine.max_model_len - len(ids)
    if room < 1:
        print(f"error: the prompt has {len(ids)} tokens; the model's context holds {engine.max_model_len}",
              file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=min(args.max_tokens, room))
    for delta in stream_text(engine, ids, params):
        print(delta, end="", flush=True)
    print()
    return 0
