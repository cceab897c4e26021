"""Drives two vLLM instances that use kvfabric's connector (scripts/engines/vllm-connector.sh):
for each of a few long prompts (random token ids), the time to first token when

- A computes it (cold: kvfabric only saves),
- B loads it from A's store through the fabric (remote),
- B loads it from its own host tier (after vLLM's own prefix cache was reset),
- A loads it from its disk tier (at the end: A's small host tier holds only the last prompt),

and whether the greedy output is the same every time. Standard library only.
"""

import argparse
import json
import random
import statistics
import time
import urllib.request


def post(url, body, stream=False):
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


def reset(base):
    post(base + "/reset_prefix_cache", {}).read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.tokens)] for _ in range(args.prompts)]
    complete(args.a, args.model, [5, 6, 7], 2)  # warm both up (compilation, first request)
    complete(args.b, args.model, [5, 6, 7], 2)
    rows = {"compute (A cold)": [], "remote (B from A)": [], "host (B)": [], "disk (A)": []}
    texts = []
    for p in prompts:
        t, text_a, c = complete(args.a, args.model, p)
        rows["compute (A cold)"].append(t)
        time.sleep(1.0)  # A's saves end in the background
        t, text_b, c_b = complete(args.b, args.model, p)
        rows["remote (B from A)"].append(t)
        reset(args.b)
        t, text_b2, _ = complete(args.b, args.model, p)
        rows["host (B)"].append(t)
        texts.append((text_a, text_b, text_b2))
        print(f"prompt of {len(p)} tokens: A computed {rows['compute (A cold)'][-1]:.3f} s, "
              f"B from A {rows['remote (B from A)'][-1]:.3f} s (cached tokens reported {c_b}), "
              f"B host {rows['host (B)'][-1]:.3f} s", flush=True)
    reset(args.a)
    for i, p in enumerate(prompts[:-1]):
        t, text_d, _ = complete(args.a, args.model, p)
        rows["disk (A)"].append(t)
        texts[i] = texts[i] + (text_d,)
        print(f"prompt {i}: A from disk {t:.3f} s", flush=True)
    print()
    print(f"{'time to first token':<20} {'n':>3} {'median s':>9} {'min s':>7} {'x compute':>10}")
    base = statistics.median(rows["compute (A cold)"])
    for name, v in rows.items():
        if v:
            m = statistics.median(v)
            print(f"{name:<20} {len(v):>3} {m:>9.3f} {min(v):>7.3f} {base / m:>10.1f}")
    same = all(len(set(t)) == 1 for t in texts)
    print()
    print("greedy output identical across compute/remote/host/disk:", same)
    for t in texts:
        print("  ", [x[:40] for x in t])
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
