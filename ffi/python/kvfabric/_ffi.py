"""ctypes declarations of libkvfabric_ffi (ffi/include/kvfabric.h)."""

from __future__ import annotations

import ctypes
import importlib.resources
import os
from ctypes import POINTER, c_bool, c_char, c_char_p, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p

# kvf_result codes (ffi/include/kvfabric.h).
CODES = {
    0: "KVF_OK",
    7001: "KVF_NULL_PARAMETER",
    7002: "KVF_PANIC",
    7003: "KVF_INVALID_ARGUMENT",
    7004: "KVF_INVALID_CONFIG",
    7005: "KVF_BUFFER_TOO_SMALL",
    7006: "KVF_NOT_FOUND",
    7007: "KVF_OUT_OF_BOUNDS",
    7008: "KVF_IN_USE",
    7009: "KVF_FULL",
    7010: "KVF_TIMED_OUT",
    7011: "KVF_TRANSFER",
    7012: "KVF_IO",
    7013: "KVF_CONTROL_PLANE",
    7014: "KVF_UNSUPPORTED",
}
globals().update({name: code for code, name in CODES.items()})

KVF_MEM_HOST = 0
KVF_MEM_DEVICE = 1
KVF_OP_READ = 0
KVF_OP_WRITE = 1
KVF_TRANSFER_CHECKSUM = 1
KVF_WAIT_FOREVER = 0xFFFFFFFF
KVF_TIER_DEVICE = 0
KVF_TIER_HOST = 1
KVF_TIER_DISK = 2
KVF_TIER_REMOTE = 3
TIER_NAMES = {0: "device", 1: "host", 2: "disk", 3: "remote"}


class kvf_desc(ctypes.Structure):
    _fields_ = [("region", c_uint64), ("offset", c_uint64), ("len", c_uint64)]


class kvf_segment(ctypes.Structure):
    _fields_ = [("region", c_uint64), ("offset", c_uint64), ("block_stride", c_uint64), ("bytes", c_uint64)]


LIBRARY = "libkvfabric_ffi"


def _find_library() -> str:
    """$KVFABRIC_LIB; else the library inside this package (a wheel ships it there, named
    with the interpreter's extension suffix: libkvfabric_ffi.cpython-311-x86_64-linux-gnu.so);
    else, in a source checkout, the cargo target directories (release first)."""
    env = os.environ.get("KVFABRIC_LIB")
    if env:
        return env
    # The package's own resources: an installed package is a directory on disk (ctypes
    # cannot load a library out of a zip, so nothing is extracted).
    package = importlib.resources.files(__package__ or "kvfabric")
    shipped = sorted(
        str(f) for f in package.iterdir() if f.name.startswith(LIBRARY) and f.name.endswith(".so")
    )
    if shipped:
        return shipped[0]
    here = os.path.dirname(os.path.abspath(__file__))
    # ffi/python/kvfabric -> the repository root's target/.
    roots = [os.environ.get("CARGO_TARGET_DIR"), os.path.join(here, "..", "..", "..", "target")]
    for root in filter(None, roots):
        for profile in ("release", "debug"):
            for sub in ("", "deps"):
                p = os.path.join(root, profile, sub, LIBRARY + ".so")
                if os.path.exists(p):
                    return p
    raise OSError(
        f"{LIBRARY}.so not found: install the kvfabric wheel (pip install kvfabric), build it "
        "(cargo build -p kvfabric-ffi), or set KVFABRIC_LIB"
    )


class Opaque(ctypes.Structure):
    pass


H = POINTER(Opaque)
HH = POINTER(H)
R = c_uint32


# Every function of ffi/include/kvfabric.h: name -> (restype, argtypes). tests/test_abi.py
# checks this table against the header (names, arity, types), and the result codes, constants
# and structs above.
SIGNATURES = {
    "kvf_version": (c_char_p, []),
    "kvf_result_text": (R, [c_uint32, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_discovery_get": (R, [c_char_p, c_char_p, c_char_p, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_config_new": (R, [HH]),
    "kvf_config_set": (R, [H, c_char_p, c_char_p]),
    "kvf_config_last_error": (R, [H, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_config_free": (None, [H]),
    "kvf_agent_new": (R, [H, HH]),
    "kvf_agent_free": (None, [H]),
    "kvf_agent_last_error": (R, [H, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_agent_metadata": (R, [H, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_agent_name": (R, [H, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_agent_load_peer": (R, [H, POINTER(c_uint8), c_size_t]),
    "kvf_agent_remove_peer": (R, [H, c_char_p]),
    "kvf_agent_register": (R, [H, c_void_p, c_size_t, c_uint32, c_bool, POINTER(c_uint64)]),
    "kvf_agent_deregister": (R, [H, c_uint64]),
    "kvf_agent_transfer": (
        R,
        [H, c_uint32, c_char_p, POINTER(kvf_desc), POINTER(kvf_desc), c_size_t, POINTER(c_uint8), c_size_t,
         c_uint32, c_uint32, HH],
    ),
    "kvf_agent_wait_notification": (
        R,
        [H, c_uint32, POINTER(c_char), c_size_t, POINTER(c_size_t), POINTER(c_uint8), c_size_t,
         POINTER(c_size_t)],
    ),
    "kvf_store_new": (R, [H, H, HH]),
    "kvf_store_salted": (R, [H, c_char_p, HH]),
    "kvf_store_free": (None, [H]),
    "kvf_store_last_error": (R, [H, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_store_block_info": (R, [H, POINTER(c_uint32), POINTER(c_uint64)]),
    "kvf_store_hashes": (R, [H, POINTER(c_uint32), c_size_t, POINTER(c_uint64), c_size_t, POINTER(c_size_t)]),
    "kvf_store_lookup": (R, [H, POINTER(c_uint32), c_size_t, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_store_save": (
        R,
        [H, POINTER(c_uint32), c_size_t, c_size_t, POINTER(c_uint32), c_size_t, POINTER(kvf_segment), c_size_t,
         HH],
    ),
    "kvf_store_load": (
        R,
        [H, POINTER(c_uint32), c_size_t, c_size_t, POINTER(c_uint32), c_size_t, POINTER(kvf_segment), c_size_t,
         HH],
    ),
    "kvf_store_publish_stored": (R, [H, POINTER(c_uint32), c_size_t, c_size_t, c_size_t, c_uint32]),
    "kvf_store_publish_removed": (R, [H, POINTER(c_uint64), c_size_t, c_uint32]),
    "kvf_store_node_info": (R, [H, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_store_add_node": (R, [H, POINTER(c_uint8), c_size_t]),
    "kvf_store_add_lookup_node": (R, [H, POINTER(c_uint8), c_size_t]),
    "kvf_store_metrics": (R, [H, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_store_health": (R, [H, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "kvf_op_wait": (R, [H, c_uint32, POINTER(c_uint64)]),
    "kvf_op_poll": (R, [H, POINTER(c_bool)]),
    "kvf_op_error": (R, [H, POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvf_op_free": (None, [H]),
}


def load(path: str | None = None, expect_version: str | None = None) -> ctypes.CDLL:
    """Loads the library and declares its functions. With ``expect_version``, a library of
    another version is refused with an error naming both (and the file)."""
    path = path or _find_library()
    lib = ctypes.CDLL(path)
    lib.kvf_version.restype = c_char_p
    lib.kvf_version.argtypes = []
    if expect_version is not None:
        found = lib.kvf_version().decode()
        if found != expect_version:
            raise ImportError(
                f"{path} is libkvfabric_ffi {found}, but this kvfabric package is {expect_version}: "
                "install matching versions (or point KVFABRIC_LIB at a matching build)"
            )
    for name, (restype, argtypes) in SIGNATURES.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    return lib
