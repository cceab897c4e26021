"""The engine-independent half of kvfabric's KV connectors: what vLLM's connector
(:mod:`kvfabric.vllm`) and TensorRT-LLM's (:mod:`kvfabric.trtllm`) share.

An engine runs its scheduler and its workers in different processes (vLLM V1: the engine
core and one worker process per rank). So:

- Each worker process owns a kvfabric store (:class:`WorkerStore`): host tier, optional
  disk tier, and the fabric (G4) as its remote tier. It registers the engine's paged KV
  buffers, loads blocks into them and saves computed blocks out of them. It serves its
  store over the transfer engine (authenticated by the shared secret), and publishes its
  node info in a node directory on the host, keyed by the engine instance and rank.
- The scheduler process (:class:`SchedulerLookup`) holds no KV. It asks the worker stores
  of its own instance (all ranks: a block counts only when every rank holds its shard)
  which leading run of a prompt they can provide, from their tiers and the fabric.
- Engines share KV through the fabric: other instances' worker stores of the same rank
  (found in discovery: etcd's when ``etcd`` is configured, else a directory per rank under
  the node directory, which the store itself registers in and follows) or dedicated
  ``kvfabric fabric`` nodes are the remote tier. With ``share``, every saved block is also put to the fabric,
  which is needed when more than two stores share (each block has one home on the ring).

Failures never reach the engine as exceptions: an unreachable worker store or fabric is a
miss, a block that cannot be loaded (dead peer, checksum) is reported per block so that the
engine computes it; each cause is logged once (and again when it recovers) and counted in
:class:`Stats`.

kvfabric config keys handled here (the rest go to the store, see ``kvfabric.h``):
``name`` (the engine instance, required), ``node_dir`` (default
``$TMPDIR/kvfabric-<uid>``), ``serve`` (make this worker store a fabric node for other
stores: default true), ``async_save`` (default true), ``async_load`` (vLLM: a request
waits for its hit's blocks outside the step, default true).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Optional, Sequence

from . import Agent, KvfError, Store, segments

log = logging.getLogger("kvfabric.connector")

# Keys the connector reads; never passed to the library.
_CONNECTOR_KEYS = {"node_dir", "async_save", "async_load", "on_load_error"}


class _Once:
    """Logs a failing cause once, and once again when it works again."""

    def __init__(self):
        self._failing: dict[str, bool] = {}
        self._lock = threading.Lock()

    def failed(self, what: str, err: object, then: str = "the engine computes these tokens itself"):
        with self._lock:
            if self._failing.get(what):
                return
            self._failing[what] = True
        log.warning("kvfabric: %s failed (%s); %s", what, err, then)

    def ok(self, what: str):
        with self._lock:
            if not self._failing.get(what):
                return
            self._failing[what] = False
        log.info("kvfabric: %s works again", what)


# Counters of the control plane (``kvf_store_metrics``'s ``control_plane``) that the worker
# reports as increases per interval.
CONTROL_PLANE_COUNTERS = ("reconnects", "lease_renewals_failed", "events_dropped")


class Stats:
    """Counters of one connector side, cumulative and per interval (vLLM asks for the
    interval's values each step)."""

    FIELDS = (
        "lookups",  # prompts looked up
        "lookup_hit_tokens",  # tokens the lookups found beyond the engine's own cache
        "lookup_errors",  # lookups that failed (counted as misses)
        "loaded_blocks",
        "load_failed_blocks",  # blocks the engine had to compute after all
        "load_failed_requests",  # requests whose load failed: computed, not looked up again
        "load_seconds",
        "saved_blocks",  # blocks the store took (those it held already not counted)
        "save_errors",  # saves that failed (the blocks are not cached)
    )

    def __init__(self):
        self._lock = threading.Lock()
        self.total = dict.fromkeys(self.FIELDS, 0)
        self._interval = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts):
        with self._lock:
            for k, v in counts.items():
                self.total[k] += v
                self._interval[k] += v

    def take_interval(self) -> dict:
        with self._lock:
            out, self._interval = self._interval, dict.fromkeys(self.FIELDS, 0)
        return out


class NodeDir:
    """Node info of the worker stores on this host, one file per instance and rank
    (``<instance>.rank<r>.node``: the owner's pid and its node info). Entries of dead
    processes are ignored."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)

    @staticmethod
    def key(instance: str, rank: int) -> str:
        return f"{instance}.rank{rank}"

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key + ".node")

    def publish(self, key: str, info: bytes):
        tmp = self._file(key) + f".{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "info": info.hex()}, f)
        os.replace(tmp, self._file(key))

    def remove(self, key: str):
        try:
            with open(self._file(key)) as f:
                if json.load(f).get("pid") != os.getpid():
                    return  # another process took the key over
            os.unlink(self._file(key))
        except (OSError, ValueError):
            pass

    def stamp(self, key: str):
        """What changes when an entry is written again (None: no entry)."""
        try:
            st = os.stat(self._file(key))
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino, st.st_size

    def read(self, key: str) -> Optional[bytes]:
        try:
            with open(self._file(key)) as f:
                entry = json.load(f)
            pid, info = int(entry["pid"]), bytes.fromhex(entry["info"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return info if _alive(pid) else None

    def keys(self) -> list[str]:
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return sorted(n[: -len(".node")] for n in names if n.endswith(".node"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def node_dir(cfg: dict) -> NodeDir:
    path = cfg.get("node_dir") or os.path.join(tempfile.gettempdir(), f"kvfabric-{os.getuid()}")
    return NodeDir(str(path))


def _store_config(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in _CONNECTOR_KEYS}


def _open(scfg: dict) -> tuple[Agent, Store]:
    """An agent and a store on it (the agent closed again if the store fails)."""
    agent = Agent(scfg)
    try:
        return agent, Store(agent, scfg)
    except Exception:
        agent.close()
        raise


class SaltedStores:
    """A store's handles per cache salt (vLLM's per-request ``cache_salt``: a tenant's own
    namespace), opened on first use, the most recent ``cap`` kept. A request without a salt
    uses the store itself. A handle dropped from here closes once no caller holds it."""

    def __init__(self, store: Store, cap: int = 1024):
        self._store = store
        self._cap = max(int(cap), 1)
        self._views: "OrderedDict[str, Store]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, salt: Optional[str]) -> Store:
        if not salt:
            return self._store
        with self._lock:
            view = self._views.get(salt)
            if view is None:
                view = self._store.salted(str(salt))
                self._views[salt] = view
                if len(self._views) > self._cap:
                    self._views.popitem(last=False)
            else:
                self._views.move_to_end(salt)
            return view

    def close(self):
        with self._lock:
            views, self._views = list(self._views.values()), OrderedDict()
        for v in views:
            v.close()


def _flag(v, default: bool) -> bool:
    if v is None:
        return default
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


class WorkerStore:
    """The store of one worker process (one rank of an engine instance)."""

    def __init__(self, cfg: dict, rank: int = 0):
        cfg = dict(cfg)
        if "name" not in cfg:
            raise ValueError("kvfabric: the config needs a 'name' (one per engine instance)")
        self.instance = str(cfg["name"])
        self.rank = rank
        self.stats = Stats()
        self._once = _Once()
        self._cp_last: dict = {}  # (component, counter) -> its last value
        self.async_save = _flag(cfg.get("async_save"), True)
        self._nodes = node_dir(cfg)
        self.key = NodeDir.key(self.instance, rank)
        remote = _flag(cfg.get("remote"), True)
        scfg = _store_config(cfg)
        scfg.update(
            name=f"{self.instance}-rank{rank}",
            serve=True,  # always: the scheduler process asks this store
            advertise=_flag(cfg.get("serve"), True),
            remote=remote,
        )
        if remote and "etcd" not in cfg:
            # Without etcd, this rank's stores of every instance on the host find each other
            # in a directory of the rank's own (kvfabric's file discovery: an entry lives as
            # long as its process): the store registers there and follows the others.
            scfg["discovery_dir"] = os.path.join(self._nodes.path, f"rank{rank}")
        self.agent, self.store = _open(scfg)
        self.salted = SaltedStores(self.store)
        self.block_tokens, self.block_bytes = self.store.block_tokens, self.store.block_bytes
        # The scheduler process finds its own instance's worker stores here.
        self._nodes.publish(self.key, self.store.node_info())
        self._segments = None
        self._saves: dict[str, list] = {}  # req id -> save ops still running
        self._lock = threading.Lock()

    # ------------------------------------------------------------ fabric peers

    def node_info(self) -> bytes:
        return self.store.node_info()

    def add_node(self, info: bytes):
        self.store.add_node(info)

    # ------------------------------------------------------------ KV buffers

    def register(self, parts: Sequence[tuple]) -> None:
        """The engine's paged buffers as (buffer, offset, block_stride, bytes) pieces of a
        block, in block order; a buffer is a numpy array or a torch tensor (on a CUDA device it
        registers as GPU memory: saves and loads then copy D2H and H2D)."""
        regions: dict[int, int] = {}
        segs = []
        for buf, offset, stride, nbytes in parts:
            rid = regions.get(id(buf))
            if rid is None:
                rid = regions[id(buf)] = self.agent.register(buf, exported=False)
            segs.append((rid, offset, stride, nbytes))
        total = sum(p[3] for p in segs)
        if total != self.block_bytes:
            raise ValueError(f"kvfabric: a block is {total} bytes in these caches, {self.block_bytes} in the store")
        self._segments = segments(segs)

    # ------------------------------------------------------------ loads

    def start_load(self, tokens: Sequence[int], first_block: int, block_ids: Sequence[int],
                   salt: Optional[str] = None):
        """Starts loading blocks ``first_block..`` of ``tokens`` (named under the request's
        cache ``salt``) into ``block_ids``; returns a handle for :meth:`finish_load`, or None
        when the load could not even start."""
        try:
            store = self.salted.get(salt)
            return (store.load(tokens, block_ids, self._segments, first_block=first_block), time.monotonic())
        except KvfError as e:
            self._once.failed("starting a load", e)
            return None

    def finish_load(self, handle, n_blocks: int) -> int:
        """Waits for a load; returns how many leading blocks arrived (the rest must be
        computed by the engine)."""
        loaded = 0
        if handle is not None:
            op, t0 = handle
            try:
                loaded = min(op.wait(), n_blocks)
                if loaded < n_blocks:  # evicted, or a peer that no longer holds them
                    self._once.failed("loading every block", f"{n_blocks - loaded} of {n_blocks} missing")
                else:
                    self._once.ok("loading every block")
                self._once.ok("loading")
            except KvfError as e:
                self._once.failed("loading", e)
            finally:
                op.close()
            self.stats.add(load_seconds=time.monotonic() - t0)
        self.stats.add(loaded_blocks=loaded, load_failed_blocks=n_blocks - loaded)
        return loaded

    # ------------------------------------------------------------ saves

    def save(self, req_id: str, tokens: Sequence[int], first_block: int, block_ids: Sequence[int],
             salt: Optional[str] = None):
        """Starts saving blocks ``first_block..`` of ``tokens`` (named under the request's
        cache ``salt``) from ``block_ids``. With ``async_save`` it returns at once (see
        :meth:`saves_done`), else when stored."""
        try:
            op = self.salted.get(salt).save(tokens, block_ids, self._segments, first_block=first_block)
        except KvfError as e:
            self.stats.add(save_errors=1)
            self._once.failed("saving", e, "these blocks are not cached")
            return
        with self._lock:
            self._saves.setdefault(req_id, []).append((op, len(block_ids)))
        if not self.async_save:
            self._reap(req_id, block=True)

    def _reap(self, req_id: str, block: bool = False) -> bool:
        """Collects the finished saves of a request; says whether none is left running."""
        with self._lock:
            ops = self._saves.get(req_id, [])
            left = []
            for op, n in ops:
                if block or op.done():
                    try:
                        # What the store took (blocks it held already are not counted).
                        self.stats.add(saved_blocks=op.wait())
                        self._once.ok("saving")
                    except KvfError as e:
                        self.stats.add(save_errors=1)
                        self._once.failed("saving", e, "these blocks are not cached")
                    finally:
                        op.close()
                else:
                    left.append((op, n))
            if left:
                self._saves[req_id] = left
            else:
                self._saves.pop(req_id, None)
            return not left

    def saves_done(self, req_ids) -> set[str]:
        """Of these requests, those with no save running any more."""
        return {r for r in req_ids if self._reap(r)}

    def pending_saves(self) -> list[str]:
        with self._lock:
            return list(self._saves)

    def metrics(self) -> dict:
        m = self.store.metrics()
        m["connector"] = dict(self.stats.total)
        return m

    def health(self) -> dict:
        """The store's health document (``kvf_store_health``, docs/health.schema.json)."""
        return self.store.health()

    def control_plane(self) -> dict:
        """etcd's and NATS's state as this store sees them, as interval stats: per component
        ``cp_<c>_workers`` (1), ``cp_<c>_up`` (1 or 0), ``cp_<c>_contact_age_s`` and the
        increases of its counters since the last call. A loss is logged once, and so is the
        recovery. Empty without etcd or NATS (embedded ones are always there)."""
        try:
            entries = self.store.metrics().get("control_plane", [])
        except KvfError as e:
            self._once.failed("reading the store's metrics", e, "control-plane state unknown")
            return {}
        self._once.ok("reading the store's metrics")
        out = {}
        last = self._cp_last
        for c in entries:
            name = c["component"]
            out[f"cp_{name}_workers"] = 1
            out[f"cp_{name}_up"] = 1 if c["up"] else 0
            out[f"cp_{name}_contact_age_s"] = float(c["since_contact_s"])
            for k in CONTROL_PLANE_COUNTERS:
                now = int(c.get(k, 0))
                out[f"cp_{name}_{k}"] = max(0, now - last.get((name, k), now))
                last[(name, k)] = now
            what = f"reaching {name}"
            if c["up"]:
                self._once.ok(what)
            else:
                then = ("discovery is frozen" if name == "etcd"
                        else "KV events stop; requests are still served")
                self._once.failed(what, c.get("error") or "unreachable", then)
        return out

    def close(self):
        for r in self.pending_saves():
            self._reap(r, block=True)
        self._nodes.remove(self.key)
        self.salted.close()
        self.store.close()
        self.agent.close()


class SchedulerLookup:
    """The scheduler process's view: how many tokens of a prompt the instance's worker
    stores (every rank) can provide. Holds no KV."""

    def __init__(self, cfg: dict, block_tokens: int, world_size: int = 1):
        cfg = dict(cfg)
        if "name" not in cfg:
            raise ValueError("kvfabric: the config needs a 'name' (one per engine instance)")
        self.instance = str(cfg["name"])
        self.world_size = max(int(world_size), 1)
        self.block_tokens = int(block_tokens)
        self.stats = Stats()
        self._once = _Once()
        self._nodes = node_dir(cfg)
        # A client store: no tiers to speak of, no discovery, no events; only lookups.
        scfg = {k: cfg[k] for k in ("secret", "deadline_ms", "lora", "salt") if k in cfg}
        scfg.update(
            name=f"{self.instance}-scheduler-{os.getpid()}",
            block_tokens=self.block_tokens,
            block_bytes=int(cfg.get("block_bytes", 4096)),
            host_blocks=1,
            shared_host=False,
            shm=False,
        )
        self.agent, self.store = _open(scfg)
        self.salted = SaltedStores(self.store)
        self._known: dict[str, bytes] = {}
        self._stamps: dict[str, object] = {}

    def _ready(self) -> bool:
        """Adds the worker stores that published their node info (again when it changed:
        a restarted worker); says whether every rank is known."""
        for rank in range(self.world_size):
            key = NodeDir.key(self.instance, rank)
            stamp = self._nodes.stamp(key)
            if stamp is not None and key in self._known and self._stamps.get(key) == stamp:
                continue  # unchanged since it was added: no need to read it on every lookup
            info = self._nodes.read(key)
            if info is None:
                if key not in self._known:
                    self._once.failed("finding the worker store", f"no live entry {key} in {self._nodes.path}")
                    return False
                continue
            if self._known.get(key) != info:
                try:
                    self.store.add_lookup_node(info)
                    self._known[key] = info
                    self._once.ok("finding the worker store")
                except KvfError as e:
                    self._once.failed("finding the worker store", e)
                    return False
            self._stamps[key] = stamp
        return True

    def matched_tokens(self, tokens: Sequence[int], num_computed_tokens: int,
                       salt: Optional[str] = None) -> int:
        """Tokens beyond ``num_computed_tokens`` that the stores can provide under the
        request's cache ``salt``: whole blocks, and at least one prompt token left for the
        engine to compute."""
        self.stats.add(lookups=1)
        if not self._ready():
            self.stats.add(lookup_errors=1)
            return 0
        try:
            hits = len(self.salted.get(salt).lookup(tokens))
            self._once.ok("looking up")
        except KvfError as e:
            self.stats.add(lookup_errors=1)
            self._once.failed("looking up", e)
            return 0
        bs = self.block_tokens
        usable = min(hits, (len(tokens) - 1) // bs) * bs
        matched = max(usable - num_computed_tokens, 0)
        self.stats.add(lookup_hit_tokens=matched)
        return matched

    def close(self):
        self.salted.close()
        self.store.close()
        self.agent.close()
