"""The Python binding and the vLLM-shaped connector, against the real library."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

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


def computed_by_a(a, b, n, seed):
    """A computes (and saves) a prompt of ``n`` tokens, B knows A's worker store; the prompt."""
    b.worker.add_node(a.worker.node_info())
    p = prompt(n, seed=seed)
    _, ids_a, _ = a.prefill("r1", p)
    a.finish("r1", ids_a)
    return p


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


def test_connector_loads_what_another_engine_saved(tmp_path):
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-engine-a", cfg)
    b = FakeEngine("py-engine-b", cfg)
    try:
        b.worker.add_node(a.worker.node_info())
        p = prompt(50)
        matched, ids_a, errors = a.prefill("r1", p)
        assert matched == 0 and not errors and a.computed_tokens == 50
        a.finish("r1", ids_a)  # its saves have ended when its blocks are freed
        # A again: its own store holds the prompt's 3 full blocks now.
        matched, ids_a2, _ = a.prefill("r2", p)
        assert matched == 48 and a.computed_tokens == 2
        assert np.array_equal(a.token_kv(ids_a2, 50), a.reference_kv(p, 50))
        # B: served from A's store over the transfer engine, into B's own blocks.
        matched, ids_b, errors = b.prefill("r3", p)
        assert matched == 48 and not errors and b.computed_tokens == 2
        assert np.array_equal(b.token_kv(ids_b, 48), a.token_kv(ids_a2, 48))
        assert np.array_equal(b.token_kv(ids_b, 50), b.reference_kv(p, 50))
        b.finish("r3", ids_b)
        # A prompt that only shares the first block.
        q = p[:16] + prompt(40, seed=7)
        matched, ids_q, _ = b.prefill("r4", q)
        assert matched == 16 and b.computed_tokens == 40
        assert np.array_equal(b.token_kv(ids_q, 56), b.reference_kv(q, 56))
        for e, r, ids in [(a, "r2", ids_a2), (b, "r4", ids_q)]:
            e.finish(r, ids)
        # What the connectors counted.
        assert a.worker.stats.total["saved_blocks"] == 3 and b.worker.stats.total["loaded_blocks"] == 3 + 1
        assert b.scheduler.stats.total["lookup_hit_tokens"] == 48 + 16
        m = b.worker.worker_store.metrics()
        assert m["connector"]["load_failed_blocks"] == 0 and m["host_used_blocks"] >= 3
        # The store's health document (docs/health.schema.json), as /health serves it.
        h = b.worker.worker_store.health()
        assert h["status"] == "ok" and h["reasons"] == [], h
        assert h["store"] == {} and h["transfer"]["failed"] == 0, h
        assert h["transfer"]["rdma"]["state"] in ("off", "unavailable", "device"), h
    finally:
        b.close()
        a.close()


def test_a_cache_salt_is_a_tenant_of_its_own_in_the_store_and_across_engines(tmp_path):
    """vLLM's per-request ``cache_salt``: a prompt saved under one salt is a miss for another
    salt and for no salt, on this engine's store and through the fabric from another engine;
    a hit for the same salt on both, its KV intact."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-salt-a", cfg)
    b = FakeEngine("py-salt-b", cfg)
    try:
        b.worker.add_node(a.worker.node_info())
        p = prompt(50, seed=11)
        matched, ids, _ = a.prefill("alice-1", p, cache_salt="alice")
        assert matched == 0
        a.finish("alice-1", ids)
        assert a.worker.stats.total["saved_blocks"] == 3
        ws = a.worker.worker_store
        assert len(ws.salted.get("alice").lookup(p)) == 3 and ws.store.lookup(p) == []
        # Each other tenant once (a tenant that computed the prompt has it from then on).
        for engine, rid, salt in [(b, "anon-b", None), (a, "bob-a", "bob"), (b, "carol-b", "carol")]:
            matched, ids, _ = engine.prefill(rid, p, cache_salt=salt)
            assert matched == 0, f"{rid}: another tenant's blocks were offered"
            assert engine.computed_tokens == 50
            engine.finish(rid, ids)
        # The same tenant, on either engine: a hit, the KV its own computation gives.
        for engine, rid in [(a, "alice-2"), (b, "alice-3")]:
            matched, ids, errors = engine.prefill(rid, p, cache_salt="alice")
            assert matched == 48 and not errors, rid
            assert np.array_equal(engine.token_kv(ids, 50), engine.reference_kv(p, 50))
            engine.finish(rid, ids)
        # The salted names are not the unsalted ones, and a salt composes with the store's.
        store = a.worker.worker_store.store
        alice = a.worker.worker_store.salted.get("alice")
        assert alice.hashes(p) != store.hashes(p)
        assert alice.hashes(p) == store.salted("alice").hashes(p)
    finally:
        b.close()
        a.close()


def test_connector_across_processes(tmp_path):
    """Engine A in another process saves a prompt; engine B here loads it: bytes equal."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {HERE!r})
        sys.path.insert(0, {os.path.dirname(HERE)!r})
        from fake_engine import FakeEngine
        from test_connector import prompt
        a = FakeEngine("py-proc-a", {{"secret": {SECRET!r}, "host_blocks": 64, "node_dir": {str(tmp_path)!r}}})
        _, ids, _ = a.prefill("r1", prompt(70, seed=3))
        a.finish("r1", ids)
        print(a.worker.node_info().hex(), flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
        a.close()
        """
    )
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        info = bytes.fromhex(child.stdout.readline().strip())
        assert info, "the child printed no node info"
        b = FakeEngine("py-proc-b", {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path / "b")})
        try:
            b.worker.add_node(info)
            p = prompt(70, seed=3)
            matched, ids, errors = b.prefill("r1", p)
            assert matched == 64 and not errors and b.computed_tokens == 6
            assert np.array_equal(b.token_kv(ids, 70), b.reference_kv(p, 70))
        finally:
            b.close()
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0


def test_failed_loads_are_reported_per_block(tmp_path):
    # Loads within the step (the asynchronous ones: test_an_async_load_that_fails_...).
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path), "async_load": False}
    a = FakeEngine("py-fail-a", cfg)
    b = FakeEngine("py-fail-b", cfg)
    try:
        p = computed_by_a(a, b, 40, 11)
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
        assert b.worker.stats.total["load_failed_blocks"] == 2 and b.worker.stats.total["loaded_blocks"] == 0
        # The fabric is gone: the same prompt is now a plain miss.
        matched, _ = b.scheduler.get_num_new_matched_tokens(request, 0)
        assert matched == 0
    finally:
        b.close()
        if a is not None:
            a.close()


def test_scheduler_without_its_worker_store_sees_misses(tmp_path):
    """The scheduler asks the worker store of its instance; when that process is gone (or
    not up yet), every lookup is a miss, counted, and the engine computes."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-nostore", cfg)
    try:
        p = prompt(40, seed=5)
        _, ids, _ = a.prefill("r1", p)
        a.finish("r1", ids)
        request = type("R", (), {"request_id": "y", "prompt_token_ids": p})()
        # A hit loads asynchronously (the default); a miss has nothing to load.
        assert a.scheduler.get_num_new_matched_tokens(request, 0) == (32, True)
        assert a.scheduler.get_num_new_matched_tokens(request, 16) == (16, True)
        a.worker.shutdown()  # the worker process ends: its node entry goes with it
        assert a.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        st = a.scheduler.stats.total
        assert st["lookups"] == 4 and st["lookup_errors"] == 1 and st["lookup_hit_tokens"] == 48
    finally:
        a.scheduler.shutdown()


def test_node_directory_finds_other_instances(tmp_path):
    """Without etcd, worker stores on one host find each other in the node directory."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-dir-a", cfg)
    b = FakeEngine("py-dir-b", cfg)  # finds A when it starts
    try:
        p = prompt(64, seed=9)
        _, ids, _ = a.prefill("r1", p)
        a.finish("r1", ids)
        matched, ids_b, errors = b.prefill("r2", p)
        assert matched == 48 and not errors
        assert np.array_equal(b.token_kv(ids_b, 64), b.reference_kv(p, 64))
        b.finish("r2", ids_b)
        # Each follows the other in the rank's discovery directory; an entry whose process is
        # gone (no lock held) is not a node.
        ghost = {"pid": 999999999, "instance": {"kind": "fabric", "id": "ghost-rank0", "metadata": {}}}
        (tmp_path / "rank0" / "fabric.ghost-rank0.json").write_text(json.dumps(ghost))
        time.sleep(0.5)
        assert b.worker.worker_store.metrics()["fabric_nodes"] == ["py-dir-a-rank0"]
        assert a.worker.worker_store.metrics()["fabric_nodes"] == ["py-dir-b-rank0"]
    finally:
        b.close()
        a.close()


def test_shared_blocks_reach_every_instance(tmp_path):
    """With more than two stores, each block has one home on the fabric's ring; ``share``
    puts every saved block there, so every other instance finds the whole prompt."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path), "share": True}
    engines = [FakeEngine(f"py-share-{i}", cfg) for i in range(3)]
    try:
        # Each follows the others in the rank's discovery directory, those started after it
        # included.
        deadline = time.monotonic() + 10
        while any(len(e.worker.worker_store.metrics()["fabric_nodes"]) < 2 for e in engines):
            assert time.monotonic() < deadline, [e.worker.worker_store.metrics() for e in engines]
            time.sleep(0.01)
        a, b, c = engines
        p = prompt(130, seed=21)
        _, ids, _ = a.prefill("r1", p)
        a.finish("r1", ids)
        deadline = time.monotonic() + 10
        while a.worker.worker_store.metrics()["shared_blocks"] < 8:
            assert time.monotonic() < deadline, a.worker.worker_store.metrics()
            time.sleep(0.01)
        for e in (b, c):
            matched, ids_e, errors = e.prefill("r2", p)
            assert matched == 128 and not errors
            assert np.array_equal(e.token_kv(ids_e, 130), e.reference_kv(p, 130))
            e.finish("r2", ids_e)
    finally:
        for e in engines:
            e.close()


def test_tensor_parallel_ranks_must_all_hold_a_block(tmp_path):
    """With two ranks, each worker process holds its shard of every block in its own store;
    the scheduler counts a block only when both ranks provide it."""
    from types import SimpleNamespace

    from kvfabric.vllm import KVConnectorRole, KvfabricConnector

    bs, nb, shard = 16, 8, 512  # bytes of one rank's shard of a block, per layer
    cfg = {"name": "py-tp", "secret": SECRET, "host_blocks": 32, "node_dir": str(tmp_path), "block_bytes": shard,
           "async_load": False}

    def vcfg(rank):
        return SimpleNamespace(
            cache_config=SimpleNamespace(block_size=bs),
            parallel_config=SimpleNamespace(rank=rank, world_size=2, data_parallel_size=1),
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"kvfabric": cfg}),
        )

    kvcc = SimpleNamespace(num_blocks=nb)
    workers = [KvfabricConnector(vcfg(r), KVConnectorRole.WORKER, kvcc) for r in (0, 1)]
    sched = KvfabricConnector(vcfg(0), KVConnectorRole.SCHEDULER, kvcc)
    try:
        bufs = [np.full((nb, shard), r + 1, dtype=np.uint8) for r in (0, 1)]
        for w, b in zip(workers, bufs):
            w.register_kv_caches({"layer0": b})
        p = prompt(40, seed=13)
        request = SimpleNamespace(request_id="t", prompt_token_ids=p)
        # Only rank 0 saved the prompt's two blocks: not usable.
        with workers[0].worker_store.store.save(p, [0, 1], workers[0].worker_store._segments) as op:
            assert op.wait() == 2
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        # Rank 1 saved the first block only: one block is usable.
        with workers[1].worker_store.store.save(p[:16], [0], workers[1].worker_store._segments) as op:
            assert op.wait() == 1
        assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
        # Each rank's store holds its own shard's bytes.
        out = np.zeros((nb, shard), dtype=np.uint8)
        st = workers[1].worker_store
        r = st.agent.register(out)
        with st.store.load(p[:16], [5], __import__("kvfabric").segments([(r, 0, shard, shard)])) as op:
            assert op.wait() == 1
        assert (out[5] == 2).all()
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()


def test_a_request_resumed_after_preemption_loads_into_its_new_blocks(tmp_path):
    """vLLM frees a preempted request's blocks; when it resumes (a cached request with
    ``resumed_req_ids``), the connector's hit is loaded into the new blocks, and later saves
    name the new blocks, not the old ones."""
    from types import SimpleNamespace

    from fake_engine import KVCacheBlocks

    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path), "async_load": False}
    a = FakeEngine("py-resume", cfg)
    try:
        p = prompt(50, seed=17)
        _, ids, _ = a.prefill("r1", p)
        a.finish("r1", ids)
        # Request x ran before (blocks 0..3 of the engine), was preempted, and resumes.
        request = SimpleNamespace(request_id="x", prompt_token_ids=p)
        a.scheduler._reqs["x"] = __import__("kvfabric.vllm", fromlist=["ReqMeta"]).ReqMeta("x", p, [0, 1, 2, 3])
        matched, _ = a.scheduler.get_num_new_matched_tokens(request, 0)
        assert matched == 48
        new_ids = [a.free.pop(-1) for _ in range(4)]
        a.scheduler.update_state_after_alloc(request, KVCacheBlocks(new_ids), matched)
        cached = SimpleNamespace(req_ids=["x"], resumed_req_ids={"x"}, new_block_ids=[(new_ids,)],
                                 num_computed_tokens=[48])
        out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"x": 2})
        meta = a.scheduler.build_connector_meta(out)
        [step] = meta.requests
        assert step.load == (0, 3) and step.block_ids == new_ids
        a.worker.bind_connector_metadata(meta)
        a.worker.start_load_kv(None)
        a.worker.wait_for_layer_load(a.layer_names[0])
        assert not a.worker.get_block_ids_with_load_errors()
        a.worker.clear_connector_metadata()
        assert np.array_equal(a.token_kv(new_ids, 48), a.reference_kv(p, 48))
    finally:
        a.close()


def test_async_loads_wait_outside_the_step_and_match_a_recomputation(tmp_path):
    """By default a hit loads asynchronously (vLLM's WAITING_FOR_REMOTE_KVS): the lookup says
    so, the load goes to the worker in a step that schedules nothing, get_finished reports the
    request when its blocks are in, and the request then runs with them. The KV equals a
    recomputation; the same prompt with loads in the step gives the same KV."""
    for async_load in (True, False):
        cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path / str(async_load)),
               "async_load": async_load}
        a = FakeEngine(f"py-async-a-{async_load}", cfg)
        b = FakeEngine(f"py-async-b-{async_load}", cfg)
        try:
            p = computed_by_a(a, b, 70, 23)
            request = type("R", (), {"request_id": "probe", "prompt_token_ids": p})()
            assert b.scheduler.get_num_new_matched_tokens(request, 0) == (64, async_load)
            b.scheduler._lookups.clear()
            matched, ids_b, errors = b.prefill("r2", p)
            assert (matched, errors) == (64, set())
            assert (b.load_steps > 0) == async_load
            assert np.array_equal(b.token_kv(ids_b, 70), b.reference_kv(p, 70))
            assert b.worker.stats.total["loaded_blocks"] == 4
            b.finish("r2", ids_b)
        finally:
            b.close()
            a.close()


def test_an_async_load_is_over_once_its_request_is_scheduled_even_unreported(tmp_path):
    """A scheduler that never passes the workers' reports to update_connector_output (vLLM
    releases before it) still schedules the request only after its load finished: once
    scheduled, finishing it waits for nothing the load did, so its blocks are not held."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path), "async_save": False}
    a = FakeEngine("py-unreported-a", cfg)
    b = FakeEngine("py-unreported-b", cfg, connector_output=False)
    try:
        p = computed_by_a(a, b, 70, 29)
        matched, ids_b, errors = b.prefill("r2", p)
        assert (matched, errors, b.load_steps > 0) == (64, set(), True)
        assert np.array_equal(b.token_kv(ids_b, 70), b.reference_kv(p, 70))
        from types import SimpleNamespace

        delay, _ = b.scheduler.request_finished(SimpleNamespace(request_id="r2"), ids_b)
        assert not delay
        assert not b.scheduler._async_loading
    finally:
        b.close()
        a.close()


def test_an_async_load_that_fails_reports_its_blocks_and_the_request(tmp_path):
    """The fabric node goes away between the lookup and the load: the load ends with every
    block missing, get_finished still reports the request (so vLLM stops waiting), and the
    blocks are load errors (vLLM recomputes them)."""
    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-afail-a", cfg)
    b = FakeEngine("py-afail-b", cfg)
    try:
        p = computed_by_a(a, b, 40, 29)
        request = type("R", (), {"request_id": "x", "prompt_token_ids": p, "num_tokens": 40})()
        matched, is_async = b.scheduler.get_num_new_matched_tokens(request, 0)
        assert (matched, is_async) == (32, True)
        a.close()
        a = None
        from fake_engine import KVCacheBlocks

        ids = [b.free.pop(0) for _ in range(3)]
        b.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), matched)
        b.worker.bind_connector_metadata(b.scheduler.build_connector_meta(b._empty_step()))
        b.worker.start_load_kv(None)
        b.worker.clear_connector_metadata()
        import time

        deadline = time.monotonic() + 30
        recving = None
        while not recving:
            _, recving = b.worker.get_finished(set())
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert recving == {"x"}
        assert b.worker.get_block_ids_with_load_errors() == set(ids[:2])
        assert b.worker.stats.total["load_failed_blocks"] == 2
    finally:
        b.close()
        if a is not None:
            a.close()


def test_a_request_whose_load_failed_is_not_offered_the_same_blocks_again(tmp_path):
    """vLLM recomputes a failed load's blocks; when that truncates the request to no computed
    tokens it looks the request up again. The lookup still finds the blocks (the node that
    timed out still has them): offering them again loops forever (seen in a real vLLM under
    load: the same request rescheduled every step). The request computes its prompt instead;
    other requests still load."""
    from fake_engine import KVCacheBlocks

    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-refail-a", cfg)
    b = FakeEngine("py-refail-b", cfg)
    try:
        p = computed_by_a(a, b, 40, 31)

        def req(rid):
            return type("R", (), {"request_id": rid, "prompt_token_ids": p, "num_tokens": 40})()

        x = req("x")
        matched, is_async = b.scheduler.get_num_new_matched_tokens(x, 0)
        assert (matched, is_async) == (32, True)
        ids = [b.free.pop(0) for _ in range(3)]
        b.scheduler.update_state_after_alloc(x, KVCacheBlocks(ids), matched)
        # What the workers report when the load ends with its first block missing.
        output = type("Out", (), {"invalid_block_ids": {ids[0]}, "finished_recving": {"x"}})()
        b.scheduler.update_connector_output(output)
        assert b.scheduler.get_num_new_matched_tokens(x, 0) == (0, False), "offered again"
        assert b.scheduler.get_num_new_matched_tokens(req("y"), 0) == (32, True)
        # Once finished, the id is forgotten (vLLM does not reuse ids; nothing grows).
        b.scheduler.request_finished(x, ids)
        assert b.scheduler.get_num_new_matched_tokens(x, 0) == (32, True), "a new request of that id"
    finally:
        b.close()
        a.close()


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(tmp_path):
    """vLLM frees an aborted request's blocks at once unless the connector says otherwise: a
    request aborted while its blocks load keeps them until the workers report the load ended
    (the load writes them); one aborted before its load reached the workers frees them."""
    from types import SimpleNamespace

    from fake_engine import KVCacheBlocks

    cfg = {"secret": SECRET, "host_blocks": 64, "node_dir": str(tmp_path)}
    a = FakeEngine("py-abort", cfg)
    try:
        p = prompt(50, seed=31)
        _, ids, _ = a.prefill("r1", p)
        a.finish("r1", ids)
        for rid, handed in (("early", False), ("late", True)):
            request = SimpleNamespace(request_id=rid, prompt_token_ids=p, num_tokens=50)
            matched, is_async = a.scheduler.get_num_new_matched_tokens(request, 0)
            assert (matched, is_async) == (48, True)
            new_ids = [a.free.pop(0) for _ in range(4)]
            a.scheduler.update_state_after_alloc(request, KVCacheBlocks(new_ids), matched)
            if handed:
                a.worker.bind_connector_metadata(a.scheduler.build_connector_meta(a._empty_step()))
                a.worker.start_load_kv(None)
                a.worker.clear_connector_metadata()
            delay, _ = a.scheduler.request_finished(request, new_ids)
            assert delay == handed, rid
            if handed:
                import time

                deadline = time.monotonic() + 30
                recving = None
                while not recving:
                    _, recving = a.worker.get_finished({rid})
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                assert recving == {rid}
                a.scheduler.update_connector_output(SimpleNamespace(finished_recving=recving))
                assert rid not in a.scheduler._async_loading
            a.free.extend(new_ids)
    finally:
        a.close()


class _Server:
    """A real etcd or NATS server on a free loopback port, stopped and started again on it."""

    def __init__(self, argv_for_port, tmp_path):
        self._argv_for_port, self._tmp = argv_for_port, tmp_path
        self.port = _free_port()
        self._proc = None
        self.start()

    def start(self):
        self._proc = subprocess.Popen(self._argv_for_port(self.port, self._tmp),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"server on {self.port} did not start")

    def kill(self):
        """Stops it (a server already stopped stays so)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def _free_port():
    # Below the kernel's ephemeral range, so that no outgoing connection takes it while the
    # server is down (as kvfabric's Rust test kit does).
    import random
    for _ in range(512):
        port = random.randint(10_000, 30_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def _etcd(port, tmp):
    peer = _free_port()
    return ["etcd", "--name", "py", "--data-dir", str(tmp / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{port}",
            "--advertise-client-urls", f"http://127.0.0.1:{port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"py=http://127.0.0.1:{peer}"]


def _nats(port, _tmp):
    return [shutil.which("nats-server") or "/usr/sbin/nats-server", "-a", "127.0.0.1", "-p", str(port)]


class _Metric:
    """prometheus_client's surface that the connector's metrics use, recorded."""

    def __init__(self, name, documentation, labelnames, multiprocess_mode=None, **_):
        self.name, self.labelnames, self.values = name, list(labelnames), {}

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values)
        metric = self

        class Child:
            def set(self, v):
                metric.values[values] = v

            def inc(self, n=1):
                metric.values[values] = metric.values.get(values, 0) + n

        return Child()


@pytest.mark.skipif(not (shutil.which("etcd") and (shutil.which("nats-server") or os.path.exists("/usr/sbin/nats-server"))),
                    reason="etcd-server and nats-server (scripts/setup.sh test installs them)")
def test_the_worker_store_reports_etcd_and_nats_to_vllm(tmp_path, caplog, request):
    """With real etcd and NATS servers: each step's stats carry their state, vLLM's
    ``/metrics`` gets ``kvfabric_control_plane_*`` through ``build_prom_metrics``, NATS's loss
    is logged once and its return once, with the reconnect counted."""
    from kvfabric.vllm import KvfabricConnector, KvfabricStats

    # Stopped however the test ends, a failure before its `try` included.
    etcd = _Server(_etcd, tmp_path)
    request.addfinalizer(etcd.kill)
    nats = _Server(_nats, tmp_path)
    request.addfinalizer(nats.kill)
    cfg = {"secret": SECRET, "host_blocks": 16, "etcd": f"http://127.0.0.1:{etcd.port}",
           "nats": f"nats://127.0.0.1:{nats.port}", "namespace": "py-cp"}
    a = FakeEngine("py-cp-a", cfg)
    try:
        class Gauge: ...
        class Counter: ...
        class Histogram: ...
        prom = KvfabricConnector.build_prom_metrics(
            a.vllm_config, {Gauge: _Metric, Counter: _Metric, Histogram: _Metric},
            ["model_name", "engine"], {0: ["m", "0"]})
        up = prom._up

        def step():
            s = a.worker.get_kv_connector_stats()
            assert s is not None, "with etcd and NATS, every step reports them"
            prom.observe(s.data, 0)
            return s

        s = step()
        assert s.data["cp_etcd_up"] == 1 and s.data["cp_nats_up"] == 1, s.data
        assert up.values == {("m", "0", "etcd"): 1, ("m", "0", "nats"): 1}
        assert s.is_empty(), "nothing to log while all is well"

        caplog.set_level("INFO", logger="kvfabric.connector")
        nats.kill()
        deadline = time.time() + 15
        while step().data["cp_nats_up"] != 0:
            assert time.time() < deadline, "the store never saw NATS go"
            time.sleep(0.05)
        s = step()
        assert up.values[("m", "0", "nats")] == 0 and up.values[("m", "0", "etcd")] == 1
        assert s.reduce().get("nats_unreachable_reports") == 1, s.reduce()
        lost = [r for r in caplog.records if "reaching nats failed" in r.getMessage()]
        assert len(lost) == 1, [r.getMessage() for r in caplog.records]

        nats.start()
        deadline = time.time() + 30
        reconnects = 0
        while True:
            s = step()
            reconnects += s.data.get("cp_nats_reconnects", 0)
            if s.data["cp_nats_up"] == 1:
                break
            assert time.time() < deadline, "the store never saw NATS back"
            time.sleep(0.1)
        assert up.values[("m", "0", "nats")] == 1
        assert reconnects >= 1
        assert prom._counters["reconnects"].values[("m", "0", "nats")] >= 1
        back = [r for r in caplog.records if "reaching nats works again" in r.getMessage()]
        assert len(back) == 1
        # Summed over workers (two ranks here): one unreachable is reported as such.
        two = KvfabricStats(data={"cp_etcd_workers": 1, "cp_etcd_up": 1, "cp_etcd_contact_age_s": 0.5})
        two.aggregate(KvfabricStats(data={"cp_etcd_workers": 1, "cp_etcd_up": 0, "cp_etcd_contact_age_s": 7.0}))
        prom.observe(two.data, 0)
        assert up.values[("m", "0", "etcd")] == 0
        assert prom._age.values[("m", "0", "etcd")] == 7.0
        assert two.reduce() == {"etcd_unreachable_reports": 1} and not two.is_empty()
    finally:
        a.close()
        nats.kill()
        etcd.kill()
