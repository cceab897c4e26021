"""KV event publishers as vLLM and SGLang run them, for kvfabric's tests.

The msgspec structs below are declared exactly as the engines declare them (field names,
order, defaults, `tag`, `array_like`, `omit_defaults`), so that msgspec encodes the bytes the
engines put on the wire:

- ``vllm``: vLLM 0.32 (``vllm/distributed/kv_events.py``): the batch positional
  ``[ts, events, data_parallel_rank]``, each event a map tagged by ``"type"``.
- ``vllm-map``: vLLM's main branch, where the batch is a map too.
- ``vllm-legacy``: older vLLM: positional events, a batch without the rank.
- ``sglang``: SGLang (``sglang/srt/disaggregation/kv_events.py``): positional everything,
  signed 64-bit hashes, a ``medium`` field, ``attn_dp_rank``.

The publisher is the engines' ``ZmqEventPublisher``: a PUB socket sending
``[topic, seq (8 bytes big-endian), payload]`` and a ROUTER replay endpoint answering
``["", start_seq]`` with ``["", seq, payload]`` per buffered batch from ``start_seq`` on and
``["", -1, ""]`` at the end. Unlike the engines it can be told to leave a batch out of the
live stream (a gap that replay fills) and to forget its replay buffer (a gap that cannot be
filled).

Run as a program it reads one JSON command per line on stdin and answers one JSON line each:
    {"cmd": "publish", "events": [...], "send": true}   -> {"seq": N}
    {"cmd": "trim", "keep": K}                          -> {"kept": K}
    {"cmd": "quit"}
after printing {"pub": "tcp://127.0.0.1:PORT", "replay": "tcp://127.0.0.1:PORT"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import deque
from typing import Any, Optional, Union

import msgspec
import zmq

ExternalBlockHash = Union[int, bytes]


class Vllm:
    """vLLM 0.32."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: Optional[ExternalBlockHash]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[ExternalBlockHash]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass


class VllmMap(Vllm):
    """vLLM main: the batch is a map."""

    class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None


class VllmLegacy:
    """Older vLLM: positional events, no rank."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]

    class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: Optional[str]

    class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass


class Sglang:
    """SGLang."""

    class EventBatch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[Any]
        attn_dp_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str] = None

    class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: Optional[str] = None

    class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass


FLAVORS = {"vllm": Vllm, "vllm-map": VllmMap, "vllm-legacy": VllmLegacy, "sglang": Sglang}


def signed(h: int) -> int:
    """SGLang's hashes are signed 64-bit integers."""
    h &= (1 << 64) - 1
    return h - (1 << 64) if h >= 1 << 63 else h


def make_event(flavor: str, e: dict) -> Any:
    """An event struct of `flavor` from a dict in vLLM's field names."""
    m = FLAVORS[flavor]
    kind = e["type"]
    conv = signed if flavor == "sglang" else (lambda h: h)

    def h(x):
        if isinstance(x, str):  # hex: a 32-byte binary hash
            return bytes.fromhex(x)
        return conv(x)

    if kind == "BlockStored":
        args = dict(
            block_hashes=[h(x) for x in e["block_hashes"]],
            parent_block_hash=None if e.get("parent_block_hash") is None else h(e["parent_block_hash"]),
            token_ids=e["token_ids"],
            block_size=e["block_size"],
            lora_id=e.get("lora_id"),
            medium=e.get("medium"),
        )
        if flavor in ("vllm", "vllm-map"):
            n = len(e["block_hashes"])
            args.update(
                lora_name=e.get("lora_name"),
                extra_keys=e.get("extra_keys", [None] * n),
                group_idx=e.get("group_idx", 0),
                kv_cache_spec_kind=e.get("kv_cache_spec_kind", "full_attention"),
            )
        return m.BlockStored(**args)
    if kind == "BlockRemoved":
        args = dict(block_hashes=[h(x) for x in e["block_hashes"]], medium=e.get("medium"))
        if flavor in ("vllm", "vllm-map"):
            args["group_idx"] = e.get("group_idx", 0)
        return m.BlockRemoved(**args)
    if kind == "AllBlocksCleared":
        return m.AllBlocksCleared()
    raise ValueError(f"unknown event {kind}")


def make_batch(flavor: str, events: list[dict], rank: int = 0) -> Any:
    m = FLAVORS[flavor]
    evs = [make_event(flavor, e) for e in events]
    if flavor == "vllm-legacy":
        return m.EventBatch(ts=time.time(), events=evs)
    if flavor == "sglang":
        return m.EventBatch(ts=time.time(), events=evs, attn_dp_rank=rank)
    return m.EventBatch(ts=time.time(), events=evs, data_parallel_rank=rank)


class Publisher:
    """The engines' ZmqEventPublisher, with gaps on demand."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, flavor: str, pub: str, replay: Optional[str], topic: str = "kv",
                 bind: bool = True):
        self.flavor = flavor
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.pub.bind(pub)
            self.pub_endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self.pub.connect(pub)
            self.pub_endpoint = pub
        self.replay = None
        self.replay_endpoint = None
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay)
            self.replay_endpoint = self.replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.topic = topic.encode()
        self.buffer: deque = deque(maxlen=10_000)
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()
        self.running = True
        if self.replay is not None:
            threading.Thread(target=self._serve_replay, daemon=True).start()

    def publish(self, events: list[dict], send: bool = True) -> int:
        payload = self.encoder.encode(make_batch(self.flavor, events))
        # libzmq attaches a newly connected subscriber when the socket processes its
        # commands, which a send does at most every few milliseconds (throttled by the CPU's
        # tick counter). An engine publishes continuously; this test publisher is quiet
        # between commands, so it lets the socket process them first (reading EVENTS does,
        # unthrottled). Batches sent before the attach are lost to that subscriber, as with
        # an engine: its replay covers them.
        self.pub.getsockopt(zmq.EVENTS)
        with self.lock:
            seq = self.seq
            self.seq += 1
            if send:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))
        return seq

    def trim(self, keep: int) -> None:
        with self.lock:
            while len(self.buffer) > keep:
                self.buffer.popleft()

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while self.running:
            if not dict(poller.poll(100)):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start = int.from_bytes(start, "big")
            with self.lock:
                batches = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in batches:
                self.replay.send_multipart((client, b"", s.to_bytes(8, "big"), p))
            self.replay.send_multipart((client, b"", self.END_SEQ, b""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="vllm", choices=sorted(FLAVORS))
    ap.add_argument("--pub", default="tcp://127.0.0.1:*")
    ap.add_argument("--connect", action="store_true", help="connect the PUB socket instead")
    ap.add_argument("--replay", default="tcp://127.0.0.1:*")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--topic", default="kv")
    ap.add_argument("--golden", help="write one batch of each event kind as hex to this file")
    a = ap.parse_args()
    if a.golden:
        enc = msgspec.msgpack.Encoder()
        events = [
            {"type": "BlockStored", "block_hashes": [2**64 - 5, 7], "parent_block_hash": None,
             "token_ids": list(range(32)), "block_size": 16, "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7,
             "token_ids": list(range(32, 48)), "block_size": 16, "medium": "CPU_PINNED"},
            {"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU_PINNED"},
            {"type": "AllBlocksCleared"},
        ]
        batch = make_batch(a.flavor, events, rank=1)
        batch.ts = 1.5
        with open(a.golden, "w") as f:
            f.write(enc.encode(batch).hex() + "\n")
        return
    p = Publisher(a.flavor, a.pub, None if a.no_replay else a.replay, a.topic, bind=not a.connect)
    print(json.dumps({"pub": p.pub_endpoint, "replay": p.replay_endpoint}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "publish":
            seq = p.publish(cmd["events"], cmd.get("send", True))
            print(json.dumps({"seq": seq}), flush=True)
        elif cmd["cmd"] == "trim":
            p.trim(cmd["keep"])
            print(json.dumps({"kept": cmd["keep"]}), flush=True)
        elif cmd["cmd"] == "quit":
            break
    p.running = False


if __name__ == "__main__":
    main()
