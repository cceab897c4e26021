"""What the engine scripts ask a vLLM's OpenAI-compatible server (standard library only):
streamed greedy completions of token ids timed to their first token, token arrival times of a
long decode, and vLLM's prefix-cache reset (dev mode). Used by connector-demo.py and
kv-compare.py."""

import json
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def complete(base, model, tokens, max_tokens=16):
    """Streams a greedy completion of token ids; returns (seconds to first token, text,
    cached prompt tokens)."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, cached = None, [], None
    with post(base + "/v1/completions", body) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(c.get("text", ""))
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ttft, "".join(text), cached


def token_times(base, model, tokens, max_tokens, out):
    """Streams a greedy completion that ignores end-of-sequence; appends each token's arrival
    time (perf_counter) to out."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with post(base + "/v1/completions", body) as r:
        for line in r:
            if line.startswith(b"data: {"):
                out.append(time.perf_counter())


def reset(base):
    post(base + "/reset_prefix_cache", {}).read()
