"""Grammar compilation for the server, in processes that can be stopped.

xgrammar cannot be interrupted, and no cheap look at a grammar tells how long it takes: a JSON
schema of 5,000 string properties (100 KB) or 10 levels of nested anyOf compiles for more than
five minutes, 20,000 enum values for seconds and 60 MB, while larger but plainer ones take
milliseconds. So the server compiles each grammar in a child process that it kills when the time
limit passes or the client goes away, and no grammar can keep a core busy after its request ended.

The children are forked from one helper process that has imported xgrammar and holds the
vocabulary, so a child starts in milliseconds. A child sends the grammar back serialized
(`CompiledGrammar.serialize_json`: a few milliseconds for usual grammars); the server keeps it in
the engine's cache (`StructuredOutputs`) and hands it to the engine with the request, so the
engine thread never compiles for the server.

Protocol: the helper reads the vocabulary (`TokenizerInfo.serialize_json`) from stdin, then
receives one socket per job on its control socket and forks a child for it. The child sends its
pid (8 bytes), reads the job (a frame of JSON: spec and time limit) and answers with one frame:
b"O" + the serialized grammar, b"E" + the RequestError's message, or b"F" + an unexpected error.
A frame is an 8-byte little-endian length and the payload.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading

from pocketllm.errors import PocketLLMError, RequestError
from pocketllm.structured.spec import cache_key, kind_of

log = logging.getLogger("pocketllm")

# Seconds the helper may take to start (it imports xgrammar: a few seconds on a busy small machine).
HELPER_START_TIMEOUT = 120.0
# Address space a child may add to the helper's: a compilation that needs more fails alone
# (usual grammars need megabytes; the slowest ones above a few hundred).
CHILD_MEMORY_BYTES = 4 << 30
# Scheduling priority of the helper and its children below the server's (nice(2)'s increment).
HELPER_NICENESS = 10


class GrammarTimeoutError(RequestError):
    """The grammar did not compile within the time limit."""

    def __init__(self, spec: dict, time_limit: float):
        from pocketllm.structured.grammars import LABELS

        super().__init__(f"The {LABELS[kind_of(spec)]} did not compile within {time_limit:g} s, this server's "
                         "limit (--max-grammar-compile-time): simplify it (fewer properties, alternatives or enum "
                         "values, smaller repetition counts).")
        self.param = "structured_outputs"


class GrammarBusyError(PocketLLMError):
    """Every compiler process stayed busy for the whole time limit."""


class GrammarCompilerFailedError(PocketLLMError):
    """The helper process could not start or ended."""


def _frame(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack("<Q", await reader.readexactly(8))
    return await reader.readexactly(size)


class _Child:
    """A compiling child (a grandchild of the server): killed through a pidfd where there is one,
    so that a pid reused after it ended is never hit."""

    def __init__(self, pid: int):
        self.pid = pid
        self.fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None  # it waits for its job: alive

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class GrammarWorkers:
    """The server's grammar compiler: grammars come from `structured`'s cache, or are compiled in
    a child process, at most `max_parallel` at a time. Used from one event loop."""

    def __init__(self, structured, max_parallel: int | None = None):
        self.structured = structured
        self.max_parallel = max_parallel or max(2, min(8, (os.cpu_count() or 2) // 2))
        self._slots: asyncio.Semaphore | None = None
        self._starting: asyncio.Lock | None = None
        self._helper: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        # cache key -> [the compilation, how many requests wait for it]: a burst of one schema
        # (the clients of one application) compiles it once.
        self._compiling: dict[tuple[str, str], list] = {}

    async def compile(self, spec: dict, time_limit: float):
        """The compiled grammar of a normalized `structured_outputs`, compiled within `time_limit`
        seconds (GrammarTimeoutError past it; RequestError if it is invalid). Requests for one grammar
        share its compilation; it stops when every one of them is cancelled."""
        compiled = self.structured.cached(spec)
        if compiled is not None:
            return compiled
        key = cache_key(spec)
        shared = self._compiling.get(key)
        if shared is None:
            task = asyncio.ensure_future(self._compile(spec, time_limit))
            shared = self._compiling[key] = [task, 0]
            task.add_done_callback(lambda _: self._compiling.pop(key, None))
        shared[1] += 1
        try:
            return await asyncio.shield(shared[0])
        finally:
            shared[1] -= 1
            if shared[1] == 0:
                shared[0].cancel()  # nobody waits for it any more (a no-op once it is done)

    async def _compile(self, spec: dict, time_limit: float):
        if self._slots is None:
            self._slots, self._starting = asyncio.Semaphore(self.max_parallel), asyncio.Lock()
        try:
            await asyncio.wait_for(self._slots.acquire(), time_limit)
        except asyncio.TimeoutError:
            raise GrammarBusyError(f"The server is busy compiling other requests' grammars: none of its "
                                   f"{self.max_parallel} compiler processes came free within {time_limit:g} s. "
                                   "Please retry shortly.") from None
        try:
            text = await self._compile_in_child(spec, time_limit)
        finally:
            self._slots.release()
        compiled = await asyncio.to_thread(self.structured.deserialize, text)  # (xgrammar releases the GIL)
        self.structured.remember(spec, compiled)
        return compiled

    async def _compile_in_child(self, spec: dict, time_limit: float) -> str:
        control = await self._ensure_helper()
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(control, [b"J"], [theirs.fileno()])
        except OSError:
            ours.close()
            raise GrammarCompilerFailedError("the grammar compiler process has ended") from None
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        child = None
        try:
            try:
                # The helper forks the child once it has started: that wait is not the grammar's time.
                header = await asyncio.wait_for(reader.readexactly(8), HELPER_START_TIMEOUT)
                child = _Child(struct.unpack("<q", header)[0])
                writer.write(_frame(json.dumps({"spec": spec, "time_limit": time_limit}).encode()))
                answer = await asyncio.wait_for(_read_frame(reader), time_limit)
            except asyncio.TimeoutError:
                if child is None:
                    raise GrammarCompilerFailedError("the grammar compiler process did not start") from None
                raise GrammarTimeoutError(spec, time_limit) from None
            except (asyncio.IncompleteReadError, ConnectionError, ProcessLookupError):
                if self._helper is None or self._helper.poll() is not None:
                    raise GrammarCompilerFailedError("the grammar compiler process has ended") from None
                err = RequestError("The grammar could not be compiled: its compiler process ended without an "
                                   f"answer (it needed more than {CHILD_MEMORY_BYTES >> 30} GiB of memory, or "
                                   "crashed); simplify it.")
                err.param = "structured_outputs"
                raise err from None
        finally:
            if child is not None:
                child.kill()  # past its time or its client: it stops now (a finished one is gone already)
            writer.close()
        status, payload = answer[:1], answer[1:].decode()
        if status == b"O":
            return payload
        if status == b"E":
            err = RequestError(payload)
            err.param = "structured_outputs"
            raise err
        raise GrammarCompilerFailedError(f"the grammar compiler failed: {payload}")

    async def _ensure_helper(self) -> socket.socket:
        async with self._starting:
            if self._helper is not None and self._helper.poll() is None:
                return self._control
            if self._control is not None:
                self._control.close()
            info = await asyncio.to_thread(self.structured.tokenizer_info)
            vocabulary = (await asyncio.to_thread(info.serialize_json)).encode()
            ours, theirs = socket.socketpair()
            # One OpenBLAS thread (numpy's, which xgrammar imports): the helper forks, so it stays single-threaded.
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
            self._helper = subprocess.Popen([sys.executable, "-m", "pocketllm.structured.worker", str(theirs.fileno())],
                                            stdin=subprocess.PIPE, pass_fds=[theirs.fileno()], env=env)
            theirs.close()
            self._control = ours
            # The helper reads the vocabulary once it has imported xgrammar: a thread waits for that.
            threading.Thread(target=_write_and_close, args=(self._helper.stdin, vocabulary), daemon=True,
                             name="pocketllm-grammar-helper").start()
            log.info("started the grammar compiler process (pid %d)", self._helper.pid)
            return self._control

    def close(self) -> None:
        """Stop the helper (running children end at their time limit or when their job is closed)."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._helper is not None:
            self._helper.kill()
            self._helper.wait()
            self._helper = None


def _write_and_close(pipe, data: bytes) -> None:
    with contextlib.suppress(OSError):
        with pipe:
            pipe.write(data)


# -- the helper process ------------------------------------------------------------------------------
def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _serve_job(sock: socket.socket, info) -> None:
    """In a forked child: compile one grammar and send it back."""
    from pocketllm.structured.backend import compile_spec, grammar_compiler

    sock.sendall(struct.pack("<q", os.getpid()))
    (size,) = struct.unpack("<Q", _read_exactly(sock, 8))
    job = json.loads(_read_exactly(sock, size))
    # The server kills it at the time limit; the alarm ends it too if the server is gone.
    signal.alarm(math.ceil(job["time_limit"]) + 5)
    try:
        compiled = compile_spec(grammar_compiler(info), job["spec"])
        answer = b"O" + compiled.serialize_json().encode()
    except RequestError as e:
        answer = b"E" + str(e).encode()
    except Exception as e:  # noqa: BLE001  (told to the server, which logs it)
        answer = b"F" + f"{type(e).__name__}: {e}".encode()
    sock.sendall(_frame(answer))


def _limit_memory() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        own = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = own + CHILD_MEMORY_BYTES
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(control_fd: int) -> None:
    import xgrammar as xgr

    import pocketllm.structured.grammars  # noqa: F401  (imported once here, not in every child)

    control = socket.socket(fileno=control_fd)
    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.buffer.read().decode())
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the server's process group: the server decides
    # Compilations yield the cores to the engine's steps (on a small machine a compilation of seconds
    # beside the engine otherwise doubles the steps' times for every stream).
    with contextlib.suppress(OSError):
        os.nice(HELPER_NICENESS)
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 8)
        except OSError:
            return
        if not fds:  # the server closed its end: it has ended
            return
        for fd in fds:
            if os.fork() == 0:
                status = 0
                try:
                    control.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    with contextlib.suppress(OSError, ValueError):
                        _limit_memory()
                    _serve_job(socket.socket(fileno=fd), info)
                except BaseException:  # noqa: BLE001  (the server sees the closed socket)
                    status = 1
                finally:
                    os._exit(status)
            os.close(fd)


if __name__ == "__main__":
    main(int(sys.argv[1]))
