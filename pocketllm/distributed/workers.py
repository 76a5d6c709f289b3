"""The tensor-parallel ranks 1..N-1: one process each (spawned), each loading its shard of the
model and its own KV cache, then running the steps rank 0 broadcasts (``ModelRunner.follow``).
Rank 0 is the engine's own process: the scheduler, tokenizer, server and sampler stay there.

Start-up: every rank joins the process group (gloo on the CPU, NCCL on CUDA), loads its shard at
the same time as the others, and reports ready or its error on a pipe (so that a rank that fails
to load is an error on rank 0, not a hang); rank 0 then broadcasts the KV cache's block count."""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pocketllm.config import EngineArgs
from pocketllm.distributed.parallel_state import TPGroup, set_tp
from pocketllm.errors import ConfigurationError

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def rank_device(device_type: str, rank: int) -> torch.device:
    """A rank's device, which is also where its backend takes tensors (NCCL the GPU's, gloo the host's)."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def join_group(spec: RankSpec, rank: int) -> TPGroup:
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo",
                            init_method=f"file://{spec.init_file}", rank=rank, world_size=spec.size)
    return TPGroup(rank, spec.size)


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
        from pocketllm.loaders.model_source import ModelSource
        from pocketllm.models.registry import select_runtime
        from pocketllm.runner.model_runner import ModelRunner

        args, device, dtype = spec.args, rank_device(spec.device_type, rank), _TORCH_DTYPES[spec.dtype]
        source = ModelSource.open(args.model, args.load_format)
        runtime = select_runtime(source.config, args, device.type, spec.dtype, source.quant_types)
        model = source.load(runtime.model_class, dtype, device, spec.max_model_len, seed=args.seed,
                            dequantize_at_load=args.dequantize_at_load, exact_kernels=args.exact_kernels)
        conn.send(None)
    except BaseException:  # noqa: BLE001  (rank 0 raises it)
        conn.send(traceback.format_exc())
        return
    blocks = torch.zeros(1, dtype=torch.long, device=rank_device(spec.device_type, rank))
    dist.broadcast(blocks, src=0)
    runner = ModelRunner(model, int(blocks.item()), args.block_size, dtype, device, args.seed,
                         max_model_len=spec.max_model_len, enforce_eager=True, kv_layout=runtime.kv_layout)
    runner.follow()
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
        self.spec = RankSpec(args, size, init_file, device_type, dtype, max_model_len, threads, os.getpid())
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(self.spec, rank, child), daemon=True,
                            name=f"pocketllm-tp-rank{rank}")
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        torch.set_num_threads(threads)
        try:
            self.group = join_group(self.spec, 0)
        except BaseException:
            for p in self.procs:
                p.kill()
            torch.set_num_threads(self.old_threads)
            raise
        self.following = False  # the other ranks run the steps (past the block count): they take a stop
        self.out_of_step = False  # a step failed half-way: the ranks cannot be stopped in turn, only ended

    def wait_loaded(self) -> None:
        """Every other rank's weights are in (or the first error, raised here)."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited while loading (exit code {p.exitcode})")
            error = conn.recv()
            if error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to load:\n{error}")

    def share_num_blocks(self, num_blocks: int) -> None:
        blocks = torch.tensor([num_blocks], dtype=torch.long, device=rank_device(self.spec.device_type, 0))
        dist.broadcast(blocks, src=0)
        self.following = True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the other ranks (after their current step) and leave the group."""
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
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a group left mid-collective: it goes with the process)
                pass
        torch.set_num_threads(self.old_threads)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)
