"""The Python declarations of the C ABI agree with ffi/include/kvfabric.h (which cbindgen
writes from the Rust source, and ffi/tests checks is current): every function with its
arity and types, the result codes, the constants and the structs' layouts. And one version
for the Rust workspace, this package and the library it loads."""

from __future__ import annotations

import ctypes
import os
import re

import pytest

import kvfabric
from kvfabric import _ffi

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "include", "kvfabric.h")
WORKSPACE = os.path.join(HERE, "..", "..", "..", "Cargo.toml")


def header() -> str:
    with open(HEADER) as f:
        text = f.read()
    # Comments out: doc comments mention function names and numbers.
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def c_type(decl: str):
    """The ctypes type a C parameter or return type maps to (names dropped)."""
    decl = re.sub(r"\b(const|struct)\b", " ", decl).strip()
    stars = decl.count("*")
    base = decl.replace("*", " ").split()[0]
    scalars = {
        "kvf_result": ctypes.c_uint32,
        "uint32_t": ctypes.c_uint32,
        "uint64_t": ctypes.c_uint64,
        "uint8_t": ctypes.c_uint8,
        "size_t": ctypes.c_size_t,
        "bool": ctypes.c_bool,
        "char": ctypes.c_char,
        "void": None,
        "kvf_desc": _ffi.kvf_desc,
        "kvf_segment": _ffi.kvf_segment,
    }
    opaque = {"kvf_agent", "kvf_config", "kvf_op", "kvf_store"}
    if base in opaque:
        return {1: _ffi.H, 2: _ffi.HH}[stars]
    if base == "char" and stars == 1:
        # A NUL-terminated string in (const char *) or a buffer out (char *): both are
        # declared by what Python passes.
        return "char*"
    t = scalars[base]
    for _ in range(stars):
        t = ctypes.c_void_p if t is None else ctypes.POINTER(t)
    return t


def functions() -> dict:
    out = {}
    for m in re.finditer(r"([A-Za-z_][\w \*]*?)\b(kvf_\w+)\s*\(([^)]*)\)\s*;", header()):
        ret, name, params = m.group(1), m.group(2), m.group(3).strip()
        args = [] if params in ("", "void") else [p.strip() for p in params.split(",")]
        # Each parameter without its name (the last identifier).
        args = [re.sub(r"\b\w+$", "", a).strip() for a in args]
        out[name] = (c_type(ret), [c_type(a) for a in args])
    return out


def same(declared, expected) -> bool:
    if expected == "char*":
        return declared in (ctypes.c_char_p, ctypes.POINTER(ctypes.c_char))
    return declared == expected


def test_every_function_of_the_header_is_declared_alike():
    from_header = functions()
    assert len(from_header) >= 30, sorted(from_header)
    assert set(_ffi.SIGNATURES) == set(from_header), (
        f"only in the header: {sorted(set(from_header) - set(_ffi.SIGNATURES))}; "
        f"only in Python: {sorted(set(_ffi.SIGNATURES) - set(from_header))}"
    )
    for name, (ret, args) in from_header.items():
        d_ret, d_args = _ffi.SIGNATURES[name]
        assert same(d_ret, ret), f"{name} returns {ret}, declared {d_ret}"
        assert len(d_args) == len(args), f"{name} takes {len(args)} arguments, declared {len(d_args)}"
        for i, (d, e) in enumerate(zip(d_args, args)):
            assert same(d, e), f"{name} argument {i}: {e} in the header, {d} declared"


def test_result_codes_and_constants_match_the_header():
    text = header()
    # cbindgen puts a C23/C++ underlying type (inside #if lines) between the name and the brace.
    enum = re.search(r"enum\s+kvf_result\b[^{;]*\{(.*?)\}", text, flags=re.S)
    assert enum, "no kvf_result enum in the header"
    codes = {int(v): k for k, v in re.findall(r"(KVF_\w+)\s*=\s*(\d+)", enum.group(1))}
    assert codes == _ffi.CODES
    defines = dict(re.findall(r"#define\s+(KVF_\w+)\s+(\w+)", text))
    assert defines, "no KVF_ constants in the header"
    for name, value in defines.items():
        expected = 0xFFFFFFFF if value == "UINT32_MAX" else int(value, 0)
        assert getattr(_ffi, name) == expected, f"{name}: {value} in the header"


@pytest.mark.parametrize("struct", [_ffi.kvf_desc, _ffi.kvf_segment])
def test_struct_layouts_match_the_header(struct):
    body = re.search(r"typedef struct %s\s*\{(.*?)\}" % struct.__name__, header(), flags=re.S)
    assert body, struct.__name__
    fields = re.findall(r"(\w+)\s+(\w+)\s*;", body.group(1))
    assert [(n, c_type(t)) for t, n in fields] == list(struct._fields_)


def test_one_version_for_the_workspace_the_package_and_the_library():
    with open(WORKSPACE) as f:
        cargo = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), flags=re.M).group(1)
    assert kvfabric.__version__ == cargo
    assert kvfabric.version() == cargo


def test_a_library_of_another_version_is_refused_by_name(monkeypatch):
    path = _ffi._find_library()
    with pytest.raises(ImportError) as e:
        _ffi.load(path, expect_version="9.9.9")
    message = str(e.value)
    assert "9.9.9" in message and kvfabric.__version__ in message and path in message


def test_the_installed_package_loads_the_library_it_ships():
    if not os.environ.get("KVFABRIC_TEST_INSTALLED"):
        pytest.skip("the source tree's copy: run through scripts/test-python.sh")
    assert "site-packages" in kvfabric.__file__, kvfabric.__file__
    shipped = _ffi._find_library()
    assert os.path.dirname(shipped) == os.path.dirname(kvfabric.__file__), shipped


def test_the_vllm_plugin_registers_the_connector_by_name():
    """What vLLM's plugin loader calls, against a stand-in of its factory when vLLM is not
    installed (a real vLLM run is outside CI: docs/connectors.md)."""
    import importlib.metadata as md
    import sys
    import types

    if os.environ.get("KVFABRIC_TEST_INSTALLED"):
        eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvfabric"]
        assert [e.value for e in eps] == ["kvfabric.vllm_plugin:register"]
    registry = {}

    class Factory:
        @classmethod
        def register_connector(cls, name, module_path, class_name):
            if name in registry:
                raise ValueError(f"Connector '{name}' is already registered.")
            registry[name] = (module_path, class_name)

    names = [
        "vllm",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.factory",
    ]
    try:
        import vllm  # noqa: F401

        pytest.skip("a real vLLM is installed: its own factory is tested by its run")
    except ImportError:
        pass
    stubs = {n: types.ModuleType(n) for n in names}
    stubs[names[-1]].KVConnectorFactory = Factory
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(stubs)
    try:
        from kvfabric import vllm_plugin

        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may load plugins twice in one process: no error
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    assert registry == {"KvfabricConnector": ("kvfabric.vllm", "KvfabricConnector")}
    module, cls = registry["KvfabricConnector"]
    import importlib

    assert getattr(importlib.import_module(module), cls).__name__ == "KvfabricConnector"
