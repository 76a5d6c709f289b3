"""The command line: a user's mistake is one line on stderr and exit code 2, found before a model
loads; --debug shows the traceback; every flag has help."""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import default_model_gguf, shared_path

import pocketllm
from pocketllm.cli import args as cli_args
from pocketllm.cli.main import build_parser, main
from pocketllm.config import EngineArgs
from pocketllm.errors import ConfigurationError

NOWHERE = "/nonexistent/model.gguf"


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocketllm.cli.main", *argv], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120, check=False)


def assert_one_line_error(err: str, command: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pocketllm {command}: error: "), err
    assert all(w in lines[0] for w in words), err
    assert "Traceback" not in err


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("s3cret \nsecond line\n")
    return path


MISTAKES = [
    (["serve", NOWHERE], [NOWHERE, "does not exist"]),
    (["generate", NOWHERE, "hi"], ["does not exist"]),
    (["chat", NOWHERE], ["does not exist"]),
    (["serve", "--max-model-len", "0"], ["max_model_len must be >= 1"]),
    (["generate", "hi", "--max-tokens", "-5"], ["max_tokens", "-5"]),
    (["chat", "--max-tokens", "-5"], ["max_tokens", "-5"]),
    (["pull", "nope"], ["unknown model 'nope'"]),
    (["bench", "latency", NOWHERE], ["does not exist"]),
    (["bench", "throughput", "--max-num-seqs", "0"], ["max_num_seqs"]),
    (["serve", "--port", "99999"], ["--port", "99999"]),
    (["serve", "--chat-template", "/nonexistent/t.jinja"], ["chat template", "/nonexistent/t.jinja"]),
    (["generate", "hi", "--chat", "--chat-template", "/nonexistent/t.jinja"], ["chat template"]),
    (["serve", "--api-key", "k", "--api-key-file", "KEY_FILE"], ["--api-key", "not both"]),
    (["serve", "--api-key-file", "/nonexistent/key"], ["API key file"]),
    (["quantize", "/nonexistent/hf", "OUT"], ["/nonexistent/hf"]),
    (["dummy-gguf", "OUT", "--type", "bogus"], ["bogus"]),
]


@pytest.mark.parametrize("argv, words", MISTAKES, ids=[" ".join(argv) for argv, _ in MISTAKES])
def test_a_mistake_is_one_line_and_exit_code_2(argv, words, capsys, key_file, tmp_path):
    argv = [{"KEY_FILE": str(key_file), "OUT": str(tmp_path / "out.gguf")}.get(a, a) for a in argv]
    assert main(argv) == 2
    command = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    assert_one_line_error(capsys.readouterr().err, command, *words)


def test_debug_shows_the_traceback(capsys):
    done = run_cli("--debug", "pull", "nope")
    assert done.returncode != 0 and "Traceback" in done.stderr and "unknown model 'nope'" in done.stderr
    with pytest.raises(ConfigurationError, match="unknown model"):  # after the command, too
        main(["pull", "nope", "--debug"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    here = Path(pocketllm.__file__).resolve().parent
    assert capsys.readouterr().out == f"pocketllm {pocketllm.__version__} (the pocketllm-engine distribution, from {here})\n"


@pytest.mark.parametrize("argv, usage", [(["serve", "--bogus"], "usage: pocketllm serve"),
                                         (["bench", "latency", "--bogus"], "usage: pocketllm bench latency")])
def test_an_unknown_flag_shows_the_command_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err


def test_a_port_in_use_is_reported_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        done = run_cli("serve", str(default_model_gguf()), "--port", str(port))
        elapsed = time.monotonic() - t0
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "serve", f"port {port} is in use")
    assert elapsed < 10 and "Loading" not in done.stderr + done.stdout


def test_the_api_key_comes_from_the_flag_the_file_or_the_environment(key_file, monkeypatch):
    from pocketllm.cli.serve import api_key_of

    monkeypatch.delenv("POCKETLLM_API_KEY", raising=False)
    assert api_key_of(argparse.Namespace(api_key=None, api_key_file=None)) is None
    assert api_key_of(argparse.Namespace(api_key=None, api_key_file=str(key_file))) == "s3cret"
    monkeypatch.setenv("POCKETLLM_API_KEY", "from-env")
    assert api_key_of(argparse.Namespace(api_key=None, api_key_file=None)) == "from-env"
    assert api_key_of(argparse.Namespace(api_key="flag", api_key_file=None)) == "flag"


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("argv", [["serve"], ["generate", "x"], ["chat"], ["pull"], ["quantize"], ["dummy-gguf"],
                                  ["bench", "latency"], ["bench", "throughput"], ["bench", "serve"]])
def test_every_flag_has_help(argv):
    for parser in _parsers(build_parser(argv)):
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help and action.help != argparse.SUPPRESS, (parser.prog, action.option_strings)
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= set(cli_args._HELP)


def test_the_errors_name_the_flag_and_the_python_argument():
    import torch

    from pocketllm import get_tokenizer
    from pocketllm.engine.llm_engine import resolve_device

    tok = get_tokenizer(shared_path("fixtures/vocab/ggml-vocab-gpt-2.gguf"))  # has no chat template
    with pytest.raises(ConfigurationError, match=r"--chat-template FILE.*chat_template="):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match=r"--device cpu \(device='cpu' in Python\)"):
            resolve_device("cuda")


def test_help_does_not_import_torch():
    """`pocketllm --help` and a command's --help answer without loading torch (about 2 s)."""
    for argv in (["--help"], ["generate", "--help"], ["serve", "--help"]):
        code = ("import sys; from pocketllm.cli.main import main\n"
                "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
                "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'pocketllm' in m)")
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr
        assert "usage: pocketllm" in done.stdout


def test_every_command_takes_the_model_first():
    """`serve MODEL`, `chat MODEL`, `generate MODEL PROMPT` (and without MODEL, the default one)."""
    for argv in (["serve", "m.gguf"], ["chat", "m.gguf"], ["generate", "m.gguf", "hi"], ["bench", "latency", "m.gguf"]):
        assert build_parser(argv).parse_args(argv).model == "m.gguf", argv
    args = build_parser(["generate", "hi"]).parse_args(["generate", "hi"])
    assert (args.model, args.prompt) == (None, "hi")


def test_generate_runs_a_model_named_first_and_says_when_it_is_cut(capsys):
    args = ["generate", str(default_model_gguf()), "The capital of France is", "--temperature", "0",
            "--max-model-len", "64", "--num-kv-blocks", "8", "--max-tokens"]
    assert main(args + ["4"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "[stopped at 4 tokens" in out.err
    assert main(["generate", "--chat", str(default_model_gguf()), "Say hi.", "--max-tokens", "48",
                 "--temperature", "0", "--max-model-len", "128", "--num-kv-blocks", "16"]) == 0
    assert "[stopped at" not in capsys.readouterr().err  # a reply that ends on its own


def test_log_lines_do_not_run_into_the_loading_counter():
    """On a terminal, `Loading MODEL ... 1.2s` is redrawn in place; a log line written meanwhile
    starts on a cleared line, not after the counter."""
    import pty
    import re

    main_fd, sub_fd = pty.openpty()
    done = subprocess.run([sys.executable, "-m", "pocketllm.cli.main", "generate", str(default_model_gguf()), "Hi",
                           "--max-tokens", "2", "--max-model-len", "64", "--num-kv-blocks", "8"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=sub_fd, timeout=120,
                          cwd=Path(__file__).parents[1])
    os.close(sub_fd)
    raw = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        raw += chunk
    os.close(main_fd)
    assert done.returncode == 0, raw[-2000:]
    text = raw.decode(errors="replace")
    assert "Loading" in text and "INFO pocketllm: Loaded" in text
    # what each line shows: the text after its last carriage return or erase-line
    shown = [re.split(r"\r|\x1b\[K", line)[-1] for line in text.replace("\r\n", "\n").split("\n")]
    assert any(line.startswith("INFO pocketllm: Loaded") for line in shown), shown
    assert not any(re.search(r"\d\.\ds\s*INFO", line) for line in text.replace("\r\n", "\n").split("\n")
                   if "\x1b[K" not in line), text


def test_bench_latency_prints_what_one_batch_waits_for(capsys):
    assert main(["bench", "latency", str(default_model_gguf()), "--input-len", "16", "--output-len", "4",
                 "--num-iters", "1", "--max-model-len", "64", "--num-kv-blocks", "8"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "ttft_p50_s" in line)
    assert header.split() == ["concurrency", "ttft_p50_s", "prefill_tok_s", "decode_tok_s", "e2e_p50_s"]


def test_generate_chat_on_a_base_model_is_refused_before_loading(capsys):
    """The vocabulary-only GGUF below has no chat template (and no weights: loading it would fail
    with another message)."""
    assert main(["generate", "--chat", str(shared_path("fixtures/vocab/ggml-vocab-gpt-2.gguf")), "hi"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template FILE" in err and "leave out --chat" in err
