"""CUDA C kernels compiled at run time by NVRTC (which every CUDA build of torch ships) and launched
through the driver API, on torch's current stream (so CUDA graphs capture them like any kernel).

Only what Triton cannot lay out well is written this way (``gguf_gemv.cu``).  Without NVRTC or a
driver the callers keep their Triton kernels: ``available()`` says which.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading
from functools import cache

import torch

from pocketllm import envs

log = logging.getLogger("pocketllm")
_lock = threading.Lock()


def _load_nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for site in sys.path:  # the pip package's copy, where the loader does not know it yet
        names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    for name in names:
        if "builtins" in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no NVRTC library found")


class _Libs:
    def __init__(self):
        self.nvrtc = _load_nvrtc()
        self.cuda = ctypes.CDLL("libcuda.so.1")
        c_void_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.nvrtc.nvrtcCreateProgram.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_char_p, ctypes.c_char_p, c_int,
                                                  c_void_p, c_void_p]
        self.nvrtc.nvrtcCompileProgram.argtypes = [c_void_p, c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.nvrtc.nvrtcGetProgramLogSize.argtypes = [c_void_p, ctypes.POINTER(c_size_t)]
        self.nvrtc.nvrtcGetProgramLog.argtypes = [c_void_p, ctypes.c_char_p]
        self.nvrtc.nvrtcGetCUBINSize.argtypes = [c_void_p, ctypes.POINTER(c_size_t)]
        self.nvrtc.nvrtcGetCUBIN.argtypes = [c_void_p, ctypes.c_char_p]
        self.nvrtc.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(c_void_p)]
        self.cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(c_void_p), c_void_p]
        self.cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p]
        self.cuda.cuLaunchKernel.argtypes = [c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                             ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, c_void_p,
                                             ctypes.POINTER(c_void_p), c_void_p]
        self.cuda.cuCtxGetCurrent.argtypes = [ctypes.POINTER(c_void_p)]
        self.cuda.cuCtxSetCurrent.argtypes = [c_void_p]
        self.cuda.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(c_void_p), c_int]
        self.cuda.cuGetErrorString.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]


@cache
def _libs() -> _Libs:
    return _Libs()


@cache
def _loadable() -> bool:
    try:
        _libs()
    except OSError as e:
        log.warning("CUDA C kernels unavailable (%s): using the Triton kernels", e)
        return False
    return True


def available() -> bool:
    """Whether CUDA C kernels can be compiled and launched here (a CUDA device, NVRTC, the driver);
    ``POCKETLLM_DISABLE_CUDA_C=1`` turns them off (the Triton kernels run instead)."""
    if envs.flag("POCKETLLM_DISABLE_CUDA_C") or not torch.cuda.is_available():
        return False
    return _loadable()


def _check_cu(res: int, what: str) -> None:
    if res != 0:
        msg = ctypes.c_char_p()
        _libs().cuda.cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {res} ({(msg.value or b'?').decode()})")


def compile_cubin(source: str, name: str, options: list[str], arch: str) -> bytes:
    """NVRTC: ``source`` compiled for ``arch`` (e.g. ``sm_90``) to a cubin."""
    nv = _libs().nvrtc
    prog = ctypes.c_void_p()
    res = nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if res != 0:
        raise RuntimeError(f"nvrtcCreateProgram: {nv.nvrtcGetErrorString(res).decode()}")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        res = nv.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, buf)
        if res != 0:
            raise RuntimeError(f"NVRTC could not compile {name} ({' '.join(options)}):\n{buf.value.decode()}")
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def _make_current(device: torch.device) -> None:
    """The device's primary context current on this thread (torch's, where it made one)."""
    cu = _libs().cuda
    ctx = ctypes.c_void_p()
    _check_cu(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        torch.cuda.init()
        _check_cu(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device.index), "cuDevicePrimaryCtxRetain")
        _check_cu(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class Kernel:
    """A compiled kernel of one module; ``launch`` takes tensors (as pointers) and Python ints (as
    C ints), in the kernel's argument order, and launches on the current stream."""

    def __init__(self, cubin: bytes, name: str, device: torch.device):
        cu = _libs().cuda
        self.device = device
        with torch.cuda.device(device):
            _make_current(device)
            self._image = ctypes.create_string_buffer(cubin, len(cubin))
            self._module = ctypes.c_void_p()
            _check_cu(cu.cuModuleLoadData(ctypes.byref(self._module), self._image), "cuModuleLoadData")
            self._fn = ctypes.c_void_p()
            _check_cu(cu.cuModuleGetFunction(ctypes.byref(self._fn), self._module, name.encode()),
                      f"cuModuleGetFunction({name})")

        self._shared = 48 * 1024  # dynamic shared memory a launch may take without opting in

    def launch(self, grid: tuple[int, int, int], block: int, *args, shared: int = 0) -> None:
        """``shared``: bytes of dynamic shared memory."""
        if shared > self._shared:
            _check_cu(_libs().cuda.cuFuncSetAttribute(self._fn, _MAX_DYNAMIC_SHARED, shared), "cuFuncSetAttribute")
            self._shared = shared
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check_cu(_libs().cuda.cuLaunchKernel(self._fn, grid[0], grid[1], grid[2], block, 1, 1, shared,
                                              ctypes.c_void_p(stream), params, None), "cuLaunchKernel")


_kernels: dict[tuple, Kernel] = {}


def kernel(source: str, name: str, defines: dict[str, object], device: torch.device) -> Kernel:
    """``name`` of ``source`` compiled with ``defines`` for ``device`` (cached per process)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, tuple(sorted(defines.items())), device, hash(source))
    k = _kernels.get(key)
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                major, minor = torch.cuda.get_device_capability(device)
                opts = [f"-D{n}={v}" for n, v in defines.items()]
                k = _kernels[key] = Kernel(compile_cubin(source, f"{name}.cu", opts, f"sm_{major}{minor}"), name,
                                           device)
    return k
