"""The Python binding and the vLLM-shaped connector, against the real library."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvfabric
from kvfabric import Agent, KvfError, Store, segments
from fake_engine import FakeEngine

SECRET = "python-test-secret"
HERE = os.path.dirname(os.path.abspath(__file__))


def prompt(n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 50_000, size=n)]


def test_version_and_error_codes():
    assert kvfabric.version()
    with pytest.raises(KvfError) as e:
        Agent({"name": "no-secret"})
    assert e.value.name == "KVF_INVALID_CONFIG" and "secret" in str(e.value)
    with pytest.raises(KvfError) as e:
        Agent({"secret": SECRET, "bogus_key": 1})
    assert e.value.code == 7004 and "bogus_key" in str(e.value)


def test_store_round_trip_with_numpy_buffers():
    cfg = {"secret": SECRET, "name": "py-rt", "block_tokens": 4, "block_bytes": 256, "host_blocks": 8}
    with Agent(cfg) as agent, Store(agent, cfg) as store:
        src = np.arange(16 * 256, dtype=np.uint8).reshape(16, 256)
        dst = np.zeros_like(src)
        rs, rd = agent.register(src), agent.register(dst)
        toks = list(range(100, 118))  # 4 full blocks and 2 tokens
        with store.save(toks, [3, 1, 4, 15], segments([(rs, 0, 256, 256)])) as op:
            assert op.wait() == 4
        assert store.lookup(toks) == [kvfabric.KVF_TIER_HOST] * 4
        assert len(store.hashes(toks)) == 4
        with store.load(toks, [0, 2, 5, 7], segments([(rd, 0, 256, 256)])) as op:
            assert op.wait() == 4
        for got, want in zip([0, 2, 5, 7], [3, 1, 4, 15]):
            assert np.array_equal(dst[got], src[want])
        # Typed errors for bad input; nothing was changed by them.
        with pytest.raises(KvfError) as e:
            store.load(toks, [16], segments([(rd, 0, 256, 256)]))
        assert e.value.name == "KVF_OUT_OF_BOUNDS"
        with pytest.raises(KvfError) as e:
            store.save(toks, [0], segments([(rs, 0, 256, 128)]))
        assert e.value.name == "KVF_INVALID_ARGUMENT"
        with pytest.raises(ValueError):
            ro = np.zeros(64, dtype=np.uint8)
            ro.flags.writeable = False
            agent.register(ro)
        store.publish_stored(toks, 0, 4)
        store.publish_removed(store.hashes(toks)[:2])


def test_connector_loads_what_another_engine_saved():
    cfg = {"secret": SECRET, "host_blocks": 64}
    a = FakeEngine("py-engine-a", cfg)
    b = FakeEngine("py-engine-b", cfg)
    try:
        b.scheduler.add_node(a.scheduler.node_info())
        p = prompt(50)
        matched, ids_a, errors = a.prefill("r1", p)
        assert matched == 0 and not errors and a.computed_tokens == 50
        # A again: its own store holds the prompt's 3 full blocks now.
        matched, ids_a2, _ = a.prefill("r2", p)
        assert matched == 48 and a.computed_tokens == 2
        assert np.array_equal(a.token_kv(ids_a2, 50), a.reference_kv(p, 50))
        # B: served from A's store over the transfer engine, into B's own blocks.
        matched, ids_b, errors = b.prefill("r3", p)
        assert matched == 48 and not errors and b.computed_tokens == 2
        assert np.array_equal(b.token_kv(ids_b, 48), a.token_kv(ids_a, 48))
        assert np.array_equal(b.token_kv(ids_b, 50), b.reference_kv(p, 50))
        # A prompt that only shares the first block.
        q = p[:16] + prompt(40, seed=7)
        matched, ids_q, _ = b.prefill("r4", q)
        assert matched == 16 and b.computed_tokens == 40
        assert np.array_equal(b.token_kv(ids_q, 56), b.reference_kv(q, 56))
        for e, r, ids in [(a, "r1", ids_a), (a, "r2", ids_a2), (b, "r3", ids_b), (b, "r4", ids_q)]:
            e.finish(r, ids)
    finally:
        b.close()
        a.close()


def test_connector_across_processes():
    """Engine A in another process saves a prompt; engine B here loads it: bytes equal."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {HERE!r})
        sys.path.insert(0, {os.path.dirname(HERE)!r})
        from fake_engine import FakeEngine
        from test_connector import prompt
        a = FakeEngine("py-proc-a", {{"secret": {SECRET!r}, "host_blocks": 64}})
        a.prefill("r1", prompt(70, seed=3))
        print(a.scheduler.node_info().hex(), flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
        a.close()
        """
    )
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        info = bytes.fromhex(child.stdout.readline().strip())
        assert info, "the child printed no node info"
        b = FakeEngine("py-proc-b", {"secret": SECRET, "host_blocks": 64})
        try:
            b.scheduler.add_node(info)
            p = prompt(70, seed=3)
            matched, ids, errors = b.prefill("r1", p)
            assert matched == 64 and not errors and b.computed_tokens == 6
            assert np.array_equal(b.token_kv(ids, 70), b.reference_kv(p, 70))
        finally:
            b.close()
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0


def test_failed_loads_are_reported_per_block():
    cfg = {"secret": SECRET, "host_blocks": 64}
    a = FakeEngine("py-fail-a", cfg)
    b = FakeEngine("py-fail-b", cfg)
    try:
        b.scheduler.add_node(a.scheduler.node_info())
        p = prompt(40, seed=11)
        a.prefill("r1", p)
        # The lookup says 32 tokens; then A goes away before the load.
        request = type("R", (), {"request_id": "x", "prompt_token_ids": p})()
        matched, _ = b.scheduler.get_num_new_matched_tokens(request, 0)
        assert matched == 32
        a.close()
        a = None
        from types import SimpleNamespace
        from fake_engine import KVCacheBlocks

        ids = [b.free.pop(0) for _ in range(3)]
        b.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), matched)
        new = SimpleNamespace(req_id="x", prompt_token_ids=p, block_ids=(ids,), num_computed_tokens=matched)
        out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=None, num_scheduled_tokens={"x": 8})
        b.worker.bind_connector_metadata(b.scheduler.build_connector_meta(out))
        b.worker.start_load_kv(None)
        b.worker.wait_for_layer_load(b.layer_names[0])
        assert b.worker.get_block_ids_with_load_errors() == set(ids[:2])
        b.worker.clear_connector_metadata()
    finally:
        b.close()
        if a is not None:
            a.close()
