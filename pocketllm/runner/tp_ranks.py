"""The tensor-parallel ranks 1..N-1: one process each (spawned), each loading its shard of the
model and its own KV cache, then running the steps rank 0 broadcasts (``ModelRunner.follow``).
Rank 0 is the engine's own process: the scheduler, tokenizer, server and sampler stay there.

Start-up: every rank joins the process group (gloo on the CPU, NCCL on CUDA), loads its shard at
the same time as the others, and reports ready or its error on a pipe (so that a rank that fails
to load is an error on rank 0, not a hang); rank 0 then broadcasts the KV cache's block count.
Rank 0 joins on a thread while it watches the other ranks, so a rank that dies before joining is an
error within a second; the rendezvous itself times out after RENDEZVOUS_TIMEOUT.

Running: the collectives wait as long as the ranks live (an idle engine's ranks wait in one for the
next step), and a watchdog thread on rank 0 watches the rank processes instead: when one ends, the
others are killed and the engine is told at once (its own thread may be blocked for good inside a
collective with the dead rank: NCCL never notices a lost peer, so its group is aborted)."""
from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pocketllm.config import EngineArgs
from pocketllm.distributed.parallel_state import TPGroup, set_tp
from pocketllm.errors import ConfigurationError

log = logging.getLogger("pocketllm")

RENDEZVOUS_TIMEOUT = 60.0  # seconds the ranks wait for each other to join the group (processes starting)
# Past the rendezvous a collective waits as long as its ranks live: the watchdog, not a timeout,
# notices a rank that ends (a timeout would end the ranks of an engine idle for that long).
STEP_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class RankSpec:
    """What a rank needs to build the same engine's shard (all resolved by rank 0)."""

    args: EngineArgs
    size: int
    init_file: str
    device_type: str  # cpu | cuda (rank r takes cuda:r)
    dtype: str
    max_model_len: int
    num_threads: int
    parent_pid: int
    rendezvous_timeout: float  # seconds


def rank_device(device_type: str, rank: int) -> torch.device:
    """A rank's device, which is also where its backend takes tensors (NCCL the GPU's, gloo the host's)."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def _forget_abandoned_rendezvous() -> None:
    """A rendezvous given up on (a rank ended before joining) left torch's count of groups raised:
    the next default group would be named '1' where its fresh ranks say '0', and never meet them."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() and hasattr(c10d, "_world"):
        c10d._world.group_count = 0


def join_group(spec: RankSpec, rank: int) -> TPGroup:
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    _forget_abandoned_rendezvous()
    dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo",
                            init_method=f"file://{spec.init_file}", rank=rank, world_size=spec.size,
                            timeout=datetime.timedelta(seconds=spec.rendezvous_timeout))
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(STEP_TIMEOUT)  # the short timeout was the rendezvous's only
    return TPGroup(rank, spec.size)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "ended"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    oom = " (as the kernel's out-of-memory killer does)" if exitcode == -signal.SIGKILL else ""
    return f"was killed by {name}{oom}"


def _exit_with(parent: int) -> None:
    """End this rank when rank 0's process is gone (it would wait for the next step for ever)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _rank_main(spec: RankSpec, rank: int, conn) -> None:
    threading.Thread(target=_exit_with, args=(spec.parent_pid,), daemon=True).start()
    try:
        torch.set_num_threads(spec.num_threads)
        set_tp(join_group(spec, rank))
        from pocketllm.runner.worker import Worker

        args, device = spec.args, rank_device(spec.device_type, rank)
        worker = Worker.open(args.model, args, device, spec.dtype)
        worker.load(spec.max_model_len)
        # (its slots filled as rank 0 fills its own: ModelRunner.follow)
        lora = worker.lora_manager(max_rows=args.max_num_batched_tokens or 0, named=False)
        conn.send(None)
        blocks = torch.zeros(1, dtype=torch.long, device=device)
        dist.broadcast(blocks, src=0)
        # rank 0 captures the graphs; a rank replays the steps it is sent, eagerly
        worker.build_runner(int(blocks.item()), args.block_size, spec.max_model_len, enforce_eager=True,
                            lora=lora).follow()
    except BaseException:  # noqa: BLE001  (rank 0 raises it, or its watchdog reports it)
        with contextlib.suppress(OSError):
            conn.send(traceback.format_exc())
        sys.exit(1)
    dist.destroy_process_group()


class RankProcesses:
    """Ranks 1..N-1 of a tensor-parallel engine, and rank 0's membership of the group."""

    def __init__(self, args: EngineArgs, device_type: str, dtype: str, max_model_len: int):
        size = args.tensor_parallel_size
        if dist.is_initialized():
            raise ConfigurationError("a process holds one tensor-parallel engine at a time: shut the other down first")
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ConfigurationError(f"tensor_parallel_size {size} needs {size} GPUs; "
                                     f"this machine has {torch.cuda.device_count()}")
        fd, init_file = tempfile.mkstemp(prefix="pocketllm-tp-")
        os.close(fd)
        self.init_file = init_file
        self.old_threads = torch.get_num_threads()
        threads = args.num_threads or max(1, self.old_threads // size)  # the CPU's cores shared by the ranks
        self.spec = RankSpec(args, size, init_file, device_type, dtype, max_model_len, threads, os.getpid(),
                             RENDEZVOUS_TIMEOUT)
        self.following = False  # the other ranks run the steps (past the block count): they take a stop
        self.out_of_step = False  # a step failed half-way, or a rank ended: the ranks cannot be stopped in turn
        self.failure: str | None = None  # how a rank ended while the engine ran
        self._lock = threading.Lock()
        self._on_lost: Callable[[str], None] | None = None
        self._closing = threading.Event()
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(self.spec, rank, child), daemon=True,
                            name=f"pocketllm-tp-rank{rank}")
            p.start()
            child.close()  # the rank's end: its pipe reads as closed once the rank is gone
            self.procs.append(p)
            self.conns.append(parent)
        torch.set_num_threads(threads)
        try:
            self.group = self._join()
        except BaseException:
            self._end_ranks()
            if dist.is_initialized():  # joined just as a rank ended
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            torch.set_num_threads(self.old_threads)
            if os.path.exists(init_file):
                os.unlink(init_file)
            raise

    # -- start-up ------------------------------------------------------------------------------------
    def _join(self) -> TPGroup:
        """Join the group as rank 0 on a thread while watching the other ranks: one that ends before
        joining is an error within a second, not a wait for the rendezvous timeout (the thread is
        left to that timeout: torch's rendezvous cannot be cut short)."""
        joined: list = []

        def join() -> None:
            try:
                joined.append(join_group(self.spec, 0))
            except BaseException as e:  # noqa: BLE001  (raised on the caller's thread)
                joined.append(e)

        joiner = threading.Thread(target=join, name="pocketllm-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            for i, p in enumerate(self.procs):
                if not p.is_alive() and joiner.is_alive():
                    raise RuntimeError(f"{self._how_rank_ended(i)} before joining the tensor-parallel group")
        if isinstance(joined[0], BaseException):
            raise RuntimeError(f"the tensor-parallel ranks did not join the group within "
                               f"{self.spec.rendezvous_timeout:g} s: {joined[0]}") from joined[0]
        return joined[0]

    def wait_loaded(self) -> None:
        """Every other rank's weights are in (or the first error, raised here); from then on the
        watchdog watches them."""
        loading = list(range(len(self.procs)))
        while loading:
            for i in list(loading):
                if not self.conns[i].poll(0) and self.procs[i].is_alive():
                    continue
                try:
                    error = self.conns[i].recv()
                except EOFError:  # it ended without a word
                    raise RuntimeError(f"{self._how_rank_ended(i)} while loading") from None
                if error is not None:
                    raise RuntimeError(f"tensor-parallel rank {i + 1} failed to load:\n{error}")
                loading.remove(i)
            if loading:
                time.sleep(0.1)
        threading.Thread(target=self._watch, name="pocketllm-tp-watchdog", daemon=True).start()

    def share_num_blocks(self, num_blocks: int) -> None:
        blocks = torch.tensor([num_blocks], dtype=torch.long, device=rank_device(self.spec.device_type, 0))
        dist.broadcast(blocks, src=0)
        self.following = True

    # -- while running ---------------------------------------------------------------------------------
    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback` (from the watchdog's thread) with how a rank ended, if one does while
        the engine runs; at once if one already has."""
        with self._lock:
            self._on_lost = callback
            failure = self.failure
        if failure is not None:
            callback(failure)

    def lost(self, wait: float = 0.0) -> str | None:
        """How a rank ended (waiting up to `wait` seconds for one to), or None while all run."""
        if self.failure is None and not self._closing.is_set():
            ended = mp.connection.wait([p.sentinel for p in self.procs], timeout=wait)
            if ended:
                self._rank_lost(next(i for i, p in enumerate(self.procs) if p.sentinel == ended[0]))
        return self.failure

    def _watch(self) -> None:
        """Rank 0's watchdog: a rank that ends while the engine runs fails the engine within a second."""
        sentinels = [p.sentinel for p in self.procs]
        while not self._closing.is_set() and self.failure is None:
            ended = mp.connection.wait(sentinels, timeout=0.5)
            if ended and not self._closing.is_set():
                self._rank_lost(sentinels.index(ended[0]))

    def _rank_lost(self, i: int) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"{self._how_rank_ended(i)}; the engine cannot go on without it"
            self.out_of_step = True
            callback = self._on_lost
        log.error("%s", self.failure)
        self._end_ranks()  # the others wait inside a step with it for good
        if self.spec.device_type == "cuda" and dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            with contextlib.suppress(Exception):  # NCCL's collectives with the lost rank return only when aborted
                _abort_process_group()
        if callback is not None:
            callback(self.failure)

    def _how_rank_ended(self, i: int) -> str:
        """'tensor-parallel rank r (pid n) exited with code c' and the traceback it sent, if any."""
        p, conn = self.procs[i], self.conns[i]
        p.join(1.0)  # its exit code, set once it is reaped
        error = None
        with contextlib.suppress(EOFError, OSError):
            while error is None and conn.poll(0):
                error = conn.recv()  # (a None: it loaded; what follows is its error)
        ended = f"tensor-parallel rank {i + 1} (pid {p.pid}) {_how_it_ended(p.exitcode)}"
        return f"{ended}:\n{error.rstrip()}" if error else ended

    # -- the end -------------------------------------------------------------------------------------
    def _end_ranks(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (after their current step) and leave the group."""
        self._closing.set()  # the ranks' ends from here on are ours
        if self.out_of_step:
            timeout = 0.0
        elif self.following:
            from pocketllm.distributed.step_broadcast import StepBroadcast

            try:
                StepBroadcast(rank_device(self.spec.device_type, 0)).stop()
            except Exception:  # noqa: BLE001  (a rank already gone: end the others below)
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._end_ranks()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a group left mid-collective: it goes with the process)
                pass
        torch.set_num_threads(self.old_threads)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)
