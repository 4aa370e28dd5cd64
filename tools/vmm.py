"""Device buffers the judge owns and a runner maps read-only: the CUDA driver's virtual memory API.

A CUDA IPC handle (what torch shares tensors with) always maps read-write, so a kernel could use its
inputs as scratch and restore them before returning, and no after-the-call comparison would see it.
Here the judge allocates an input's physical memory itself (cuMemCreate), keeps the only read-write
mapping, and exports the allocation as a file descriptor; the runner imports that descriptor, maps
it with read access only (cuMemSetAccess) and closes the descriptor before the library runs again.
A kernel that writes through the mapping faults (CUresult 700, measured on an H200: the GPU test
`test_read_only_device_mapping_stops_a_write`), and nothing the library can reach holds the
descriptor or a writable mapping of it.

Both sides wrap the mapping as a torch tensor through `__cuda_array_interface__` (as bytes, then
viewed as the dtype: the interface has no bfloat16), which holds the owner: the mapping goes when
the last tensor on it does.
"""

from __future__ import annotations

import ctypes
import os

import torch

_u64, _size_t = ctypes.c_ulonglong, ctypes.c_size_t
_LOCATION_DEVICE, _ALLOCATION_PINNED, _HANDLE_POSIX_FD = 1, 1, 1
_PROT_READ, _PROT_READWRITE = 1, 3


class VmmError(RuntimeError):
    pass


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_CU = None


def _driver():
    """libcuda as torch loaded it (the same instance and primary context)."""
    global _CU
    if _CU is None:
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VmmError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
        cu.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(_size_t), ctypes.POINTER(_Prop), ctypes.c_int]
        cu.cuMemCreate.argtypes = [ctypes.POINTER(_u64), _size_t, ctypes.POINTER(_Prop), _u64]
        cu.cuMemRelease.argtypes = [_u64]
        cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(_u64), _size_t, _size_t, _u64, _u64]
        cu.cuMemAddressFree.argtypes = [_u64, _size_t]
        cu.cuMemMap.argtypes = [_u64, _size_t, _size_t, _u64, _u64]
        cu.cuMemUnmap.argtypes = [_u64, _size_t]
        cu.cuMemSetAccess.argtypes = [_u64, _size_t, ctypes.POINTER(_Access), _size_t]
        cu.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, _u64, ctypes.c_int, _u64]
        cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int]
        _CU = cu
    return _CU


def _ck(result: int, what: str) -> None:
    if result != 0:
        raise VmmError(f"{what} failed: CUresult {result}")


def _prop(device: int) -> _Prop:
    return _Prop(type=_ALLOCATION_PINNED, requestedHandleTypes=_HANDLE_POSIX_FD, location=_Location(_LOCATION_DEVICE, device))


def _granularity(device: int) -> int:
    gran = _size_t()
    _ck(_driver().cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(_prop(device)), 0), "cuMemGetAllocationGranularity")
    return gran.value


def _map(handle: int, size: int, device: int, access: int) -> int:
    cu = _driver()
    ptr = _u64()
    _ck(cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
    try:
        _ck(cu.cuMemMap(ptr.value, size, 0, handle, 0), "cuMemMap")
        try:
            _ck(cu.cuMemSetAccess(ptr.value, size, ctypes.byref(_Access(_Location(_LOCATION_DEVICE, device), access)), 1),
                "cuMemSetAccess")
        except VmmError:
            cu.cuMemUnmap(ptr.value, size)
            raise
    except VmmError:
        cu.cuMemAddressFree(ptr.value, size)
        raise
    return ptr.value


def _unmap(ptr: int, size: int) -> None:
    try:
        torch.cuda.synchronize()  # no kernel of this process still reads it
    except Exception:  # a context a fault broke: the mapping goes with the process
        return
    cu = _driver()
    cu.cuMemUnmap(ptr, size)
    cu.cuMemAddressFree(ptr, size)


class ExportedBuffer:
    """The judge's side: `nbytes` of device memory mapped read-write here; `export()` gives a descriptor
    to send (one per bind, closed once sent: a judge holds hundreds of sets, never their descriptors)."""

    def __init__(self, nbytes: int, device: int = 0):
        cu = _driver()
        self.device = device
        gran = _granularity(device)
        self.granularity = gran
        self.size = max(gran, -(-nbytes // gran) * gran)  # nothing but this buffer (and its padding) in it
        self.nbytes = nbytes
        handle = _u64()
        _ck(cu.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(_prop(device)), 0), "cuMemCreate")
        self._handle = handle.value
        self.ptr = 0
        try:
            self.ptr = _map(self._handle, self.size, device, _PROT_READWRITE)
        except VmmError:
            self.close()
            raise

    def export(self) -> int:
        """A new descriptor of the allocation; the caller closes it."""
        fd = ctypes.c_int(-1)
        _ck(_driver().cuMemExportToShareableHandle(ctypes.addressof(fd), self._handle, _HANDLE_POSIX_FD, 0),
            "cuMemExportToShareableHandle")
        return fd.value

    def close(self) -> None:
        if self.ptr:
            _unmap(self.ptr, self.size)
            self.ptr = 0
        if self._handle:
            _driver().cuMemRelease(self._handle)  # the memory lives on while a runner maps it
            self._handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ImportedBuffer:
    """The runner's side: the judge's allocation behind `fd`, mapped read-only here. The descriptor is
    closed before this returns: the library never sees it, so it cannot map the memory again writable."""

    def __init__(self, fd: int, size: int, device: int = 0, writable: bool = False):
        self.size = size
        self.device = device
        self.ptr = 0
        handle = _u64()
        try:
            cu = _driver()
            _ck(cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_POSIX_FD),
                "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)  # whatever happened: no descriptor stays behind
        try:
            self.ptr = _map(handle.value, size, device, _PROT_READWRITE if writable else _PROT_READ)
        finally:
            cu.cuMemRelease(handle.value)  # the mapping holds the memory; no handle stays behind

    def close(self) -> None:
        if self.ptr:
            _unmap(self.ptr, self.size)
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _ArrayInterface:
    """What torch.as_tensor wraps without copying; it keeps `owner` (the mapping) alive. The interface's
    read-only flag stays False (torch refuses True): the device mapping itself is what forbids writes."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def as_tensor(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype`/`shape` over the mapping of `buf` (an Exported- or ImportedBuffer)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * itemsize
    if nbytes > buf.size:
        raise VmmError(f"{nbytes} bytes of {dtype} do not fit the {buf.size}-byte mapping")
    device = torch.device("cuda", getattr(buf, "device", 0))
    raw = torch.as_tensor(_ArrayInterface(buf.ptr, nbytes, buf), device=device)
    return raw.view(dtype).view(tuple(shape))
