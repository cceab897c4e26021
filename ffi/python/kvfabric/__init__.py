"""Python binding of kvfabric over its C ABI (libkvfabric_ffi), with ctypes.

Objects own their handles and free them when closed or collected. Errors raise
:class:`KvfError` carrying the ``kvf_result`` code, its name, and the library's text.

    cfg = {"secret": "s", "block_tokens": 16, "block_bytes": 4096}
    with Agent(cfg) as agent, Store(agent, cfg) as store:
        region = agent.register(buf)               # numpy array or any writable buffer
        store.save(tokens, block_ids, segments).wait()
"""

from __future__ import annotations

import array
import ctypes
from ctypes import byref, c_bool, c_char, c_size_t, c_uint8, c_uint32, c_uint64
from typing import Iterable, Mapping, Sequence

from . import _ffi
from ._ffi import (  # noqa: F401  (re-exported constants)
    KVF_MEM_DEVICE,
    KVF_MEM_HOST,
    KVF_OP_READ,
    KVF_OP_WRITE,
    KVF_TIER_DEVICE,
    KVF_TIER_DISK,
    KVF_TIER_HOST,
    KVF_TIER_REMOTE,
    KVF_TRANSFER_CHECKSUM,
    KVF_WAIT_FOREVER,
    TIER_NAMES,
    kvf_desc,
    kvf_segment,
)

# The version of this package, which must be the library's (kvf_version()): one number for
# the Rust workspace, the C library and this binding (tests/test_abi.py checks all three).
__version__ = "0.1.0"

_lib = None


def lib() -> ctypes.CDLL:
    """The loaded library: $KVFABRIC_LIB, the one this package ships, or (in a source
    checkout) the cargo target directory's. A library of another version is refused."""
    global _lib
    if _lib is None:
        _lib = _ffi.load(expect_version=__version__)
    return _lib


class KvfError(Exception):
    """A kvfabric call failed: ``code`` (int), ``name`` (``KVF_...``) and the message."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.name = _ffi.CODES.get(code, f"KVF_{code}")
        super().__init__(f"{self.name}: {message}" if message else self.name)


def _text(fn, handle) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = c_size_t()
    if fn(handle, buf, len(buf), byref(n)) != 0:
        return ""
    return buf.value.decode("utf-8", "replace")


def _describe(code: int) -> str:
    buf = ctypes.create_string_buffer(256)
    n = c_size_t()
    lib().kvf_result_text(code, buf, len(buf), byref(n))
    return buf.value.decode()


def _check(code: int, last_error=None, handle=None):
    if code != 0:
        msg = _text(last_error, handle) if last_error is not None and handle else ""
        raise KvfError(code, msg or _describe(code))


def _u32_array(values: Sequence[int]):
    """A ``uint32_t`` array of ``values`` for the library (through ``array.array``: building
    a ctypes array element by element costs ~0.2 ms per thousand tokens). Values outside
    0..2^32-1 raise OverflowError."""
    arr = values if isinstance(values, array.array) and values.typecode == "I" else array.array("I", values)
    n = len(arr)
    if n == 0:
        return (c_uint32 * 1)(), 0
    # from_buffer keeps `arr` alive as long as the ctypes view.
    return (c_uint32 * n).from_buffer(arr), n


def _bytes_out(fn, *args) -> bytes:
    """Calls a function that copies bytes out, growing the buffer on KVF_BUFFER_TOO_SMALL."""
    n = c_size_t()
    cap = 4096
    while True:
        buf = (c_uint8 * cap)()
        r = fn(*args, buf, cap, byref(n))
        if r == _ffi.KVF_BUFFER_TOO_SMALL:
            cap = n.value
            continue
        return r, bytes(buf[: n.value])


class _Handle:
    """Owns one library handle: freed by ``close()``, on leaving a ``with`` block, or when
    collected. Subclasses name their ``_free`` function."""

    _h = None  # no handle until __init__ succeeds; close() and __del__ allow that
    _free = ""

    @property
    def handle(self):
        return self._h

    def _closing(self):
        """What a subclass releases with its handle."""

    def close(self):
        if self._h is not None and self._h:
            getattr(lib(), self._free)(self._h)
            self._h = _ffi.H()
            self._closing()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


class Config(_Handle):
    """A ``kvf_config`` built from a mapping (values are turned into strings)."""

    _free = "kvf_config_free"

    def __init__(self, values: Mapping[str, object]):
        self._h = _ffi.H()
        _check(lib().kvf_config_new(byref(self._h)))
        for k, v in values.items():
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, (list, tuple)):
                v = ",".join(map(str, v))
            _check(lib().kvf_config_set(self._h, str(k).encode(), str(v).encode()), lib().kvf_config_last_error, self._h)

    def last_error(self) -> str:
        return _text(lib().kvf_config_last_error, self._h)


class Op(_Handle):
    """An asynchronous operation: ``wait()`` returns its count (bytes or blocks)."""

    _free = "kvf_op_free"

    def __init__(self, handle):
        self._h = handle

    def wait(self, timeout_ms: int = KVF_WAIT_FOREVER) -> int:
        count = c_uint64()
        _check(lib().kvf_op_wait(self._h, timeout_ms, byref(count)), lib().kvf_op_error, self._h)
        return count.value

    def done(self) -> bool:
        d = c_bool()
        _check(lib().kvf_op_poll(self._h, byref(d)))
        return d.value



def _buffer_address(buf) -> tuple[int, int, int]:
    """Address, length and memory kind of a writable, contiguous buffer (numpy array,
    bytearray, a torch tensor in host memory or on a CUDA device, ...)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # a torch tensor
        device = getattr(getattr(buf, "device", None), "type", "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"the tensor is on a {device} device: kvfabric takes host or CUDA memory")
        if not buf.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        kind = KVF_MEM_DEVICE if device == "cuda" else KVF_MEM_HOST
        return int(buf.data_ptr()), int(buf.numel()) * int(buf.element_size()), kind
    iface = getattr(buf, "__array_interface__", None)
    if iface is not None:
        if iface.get("strides") is not None:
            raise ValueError("the array must be C-contiguous")
        addr, readonly = iface["data"]
        if readonly:
            raise ValueError("the array is read-only")
        return addr, buf.nbytes, KVF_MEM_HOST
    mv = memoryview(buf)
    if mv.readonly or not mv.contiguous:
        raise ValueError("the buffer must be writable and contiguous")
    c = (ctypes.c_char * mv.nbytes).from_buffer(buf)
    return ctypes.addressof(c), mv.nbytes, KVF_MEM_HOST


class Agent(_Handle):
    """A transfer agent (``kvf_agent``): registered memory, peers, transfers, notifications."""

    _free = "kvf_agent_free"

    def __init__(self, config: Mapping[str, object]):
        cfg = Config(config)
        self._h = _ffi.H()
        _check(lib().kvf_agent_new(cfg.handle, byref(self._h)), lib().kvf_config_last_error, cfg.handle)
        self._regions: dict[int, object] = {}

    def _err(self, code):
        _check(code, lib().kvf_agent_last_error, self._h)

    @property
    def name(self) -> str:
        r, b = _bytes_out(lib().kvf_agent_name, self._h)
        self._err(r)
        return b.rstrip(b"\0").decode()

    def metadata(self) -> bytes:
        r, b = _bytes_out(lib().kvf_agent_metadata, self._h)
        self._err(r)
        return b

    def load_peer(self, metadata: bytes):
        buf = (c_uint8 * len(metadata)).from_buffer_copy(metadata)
        self._err(lib().kvf_agent_load_peer(self._h, buf, len(metadata)))

    def register(self, buf, exported: bool = False) -> int:
        """Registers a writable buffer the caller keeps alive; returns its region id. A torch
        tensor on a CUDA device registers as GPU memory (the driver checks it; without CUDA
        this raises with KVF_UNSUPPORTED)."""
        addr, n, kind = _buffer_address(buf)
        region = c_uint64()
        self._err(lib().kvf_agent_register(self._h, addr, n, kind, exported, byref(region)))
        self._regions[region.value] = buf  # keeps the memory alive while registered
        return region.value

    def deregister(self, region: int):
        self._err(lib().kvf_agent_deregister(self._h, region))
        self._regions.pop(region, None)

    def transfer(self, op: int, peer: str, local: Sequence[tuple], remote: Sequence[tuple],
                 notify: bytes = b"", checksum: bool = False, timeout_ms: int = 0) -> Op:
        n = len(local)
        loc = (kvf_desc * max(n, 1))(*[kvf_desc(*d) for d in local])
        rem = (kvf_desc * max(len(remote), 1))(*[kvf_desc(*d) for d in remote])
        if len(remote) != n:
            raise ValueError("local and remote descriptor counts differ")
        note = (c_uint8 * max(len(notify), 1)).from_buffer_copy(notify or b"\0")
        h = _ffi.H()
        flags = KVF_TRANSFER_CHECKSUM if checksum else 0
        self._err(lib().kvf_agent_transfer(self._h, op, peer.encode(), loc, rem, n, note, len(notify), flags,
                                           timeout_ms, byref(h)))
        return Op(h)

    def wait_notification(self, timeout_ms: int = KVF_WAIT_FOREVER) -> tuple[str, bytes]:
        fcap, mcap = 256, 4096
        while True:
            frm = ctypes.create_string_buffer(fcap)
            msg = (c_uint8 * mcap)()
            fl, ml = c_size_t(), c_size_t()
            r = lib().kvf_agent_wait_notification(self._h, timeout_ms, frm, fcap, byref(fl), msg, mcap, byref(ml))
            if r == _ffi.KVF_BUFFER_TOO_SMALL:
                fcap, mcap = max(fcap, fl.value), max(mcap, ml.value)
                continue
            self._err(r)
            return frm.value.decode(), bytes(msg[: ml.value])

    def _closing(self):
        self._regions.clear()


def segments(parts: Iterable[tuple[int, int, int, int]]):
    """A ``kvf_segment`` array from (region, offset, block_stride, bytes) tuples."""
    parts = list(parts)
    return (kvf_segment * len(parts))(*[kvf_segment(*p) for p in parts]), len(parts)


class Store(_Handle):
    """A tiered block store (``kvf_store``) on an agent, addressed by token prefixes."""

    _free = "kvf_store_free"

    def __init__(self, agent: Agent, config: Mapping[str, object]):
        cfg = Config(config)
        self._agent = agent  # the store keeps the agent's runtime; keep the object too
        self._h = _ffi.H()
        _check(lib().kvf_store_new(agent.handle, cfg.handle, byref(self._h)), lib().kvf_config_last_error, cfg.handle)
        bt, bb = c_uint32(), c_uint64()
        self._err(lib().kvf_store_block_info(self._h, byref(bt), byref(bb)))
        self.block_tokens, self.block_bytes = bt.value, bb.value

    def _err(self, code):
        _check(code, lib().kvf_store_last_error, self._h)

    def salted(self, salt: str) -> "Store":
        """Another handle on this store whose blocks are named with ``salt`` folded in (a
        tenant's own namespace, as vLLM's per-request ``cache_salt``). Close it when done;
        the store closes with its last handle."""
        view = Store.__new__(Store)
        view._agent = self._agent
        view._h = _ffi.H()
        self._err(lib().kvf_store_salted(self._h, salt.encode(), byref(view._h)))
        view.block_tokens, view.block_bytes = self.block_tokens, self.block_bytes
        return view

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        toks, n = _u32_array(tokens)
        cap = max(n // max(self.block_tokens, 1), 1)
        out = (c_uint64 * cap)()
        got = c_size_t()
        self._err(lib().kvf_store_hashes(self._h, toks, n, out, cap, byref(got)))
        return list(out[: got.value])

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Tier (``KVF_TIER_*``) of each leading block of ``tokens`` held somewhere."""
        toks, n = _u32_array(tokens)
        cap = max(n // max(self.block_tokens, 1), 1)
        tiers = (c_uint8 * cap)()
        hits = c_size_t()
        self._err(lib().kvf_store_lookup(self._h, toks, n, tiers, cap, byref(hits)))
        return list(tiers[: min(hits.value, cap)])

    def _move(self, fn, tokens, first_block, block_ids, segs) -> Op:
        toks, n = _u32_array(tokens)
        ids, nb = _u32_array(block_ids)
        seg_arr, ns = segs
        h = _ffi.H()
        self._err(fn(self._h, toks, n, first_block, ids, nb, seg_arr, ns, byref(h)))
        return Op(h)

    def save(self, tokens: Sequence[int], block_ids: Sequence[int], segs, first_block: int = 0) -> Op:
        """Stores blocks ``first_block..`` of ``tokens`` from the caller's ``block_ids``."""
        return self._move(lib().kvf_store_save, tokens, first_block, block_ids, segs)

    def load(self, tokens: Sequence[int], block_ids: Sequence[int], segs, first_block: int = 0) -> Op:
        """Loads blocks ``first_block..`` of ``tokens`` into the caller's ``block_ids``."""
        return self._move(lib().kvf_store_load, tokens, first_block, block_ids, segs)

    def publish_stored(self, tokens: Sequence[int], first_block: int, n_blocks: int, tier: int = KVF_TIER_DEVICE):
        toks, n = _u32_array(tokens)
        self._err(lib().kvf_store_publish_stored(self._h, toks, n, first_block, n_blocks, tier))

    def publish_removed(self, hashes: Sequence[int], tier: int = KVF_TIER_DEVICE):
        arr = (c_uint64 * len(hashes))(*hashes)
        self._err(lib().kvf_store_publish_removed(self._h, arr, len(hashes), tier))

    def node_info(self) -> bytes:
        r, b = _bytes_out(lib().kvf_store_node_info, self._h)
        self._err(r)
        return b

    def add_node(self, info: bytes):
        buf = (c_uint8 * len(info)).from_buffer_copy(info)
        self._err(lib().kvf_store_add_node(self._h, buf, len(info)))

    def add_lookup_node(self, info: bytes):
        """Makes lookups ask the store with this node info (its tiers and its fabric): for a
        scheduler process whose worker process holds the store. Several: every one must
        provide a block (tensor-parallel ranks)."""
        buf = (c_uint8 * len(info)).from_buffer_copy(info)
        self._err(lib().kvf_store_add_lookup_node(self._h, buf, len(info)))

    def metrics(self) -> dict:
        """The store's metrics (tiers, hits, offloads, node lookups, sharing) as a dict."""
        import json

        r, b = _bytes_out(lib().kvf_store_metrics, self._h)
        self._err(r)
        return json.loads(b.decode())

    def health(self) -> dict:
        """The store's health document (docs/health.schema.json): ``status`` (``ok``,
        ``degraded``), ``reasons``, and its parts ``store``, ``transfer``, ``control_plane``."""
        import json

        r, b = _bytes_out(lib().kvf_store_health, self._h)
        self._err(r)
        return json.loads(b.decode())



def version() -> str:
    return lib().kvf_version().decode()


__all__ = ["Agent", "Config", "KvfError", "Op", "Store", "segments", "version", "lib", "__version__"]
