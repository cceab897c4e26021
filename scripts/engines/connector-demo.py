"""Drives two vLLM instances that use kvfabric's connector (scripts/engines/vllm-connector.sh):
for each of a few long prompts (random token ids), the time to first token when

- A computes it (cold: kvfabric only saves),
- B loads it from A's store through the fabric (remote),
- B loads it from its own host tier (after vLLM's own prefix cache was reset),
- A loads it from its disk tier (at the end: A's small host tier holds only the last prompt),

and whether the greedy output is the same every time. Then, while B streams a long decode,
B serves prompts it loads from A: how long the decode's tokens wait meanwhile (a load in the
scheduler step holds every running request's next token; an asynchronous one does not).
Standard library only.
"""

import argparse
import random
import statistics
import threading
import time

from vllm_http import complete, reset, token_times


def decode_stall(args, rng):
    """B streams a decode while it loads prompts from A: the decode's token gaps during the
    loads, against its gaps outside them."""
    prompts = [[rng.randrange(100, 40000) for _ in range(args.stall_tokens)] for _ in range(args.stall_prompts)]
    for p in prompts:
        complete(args.a, args.model, p, 1)
    time.sleep(1.0)  # A's saves end in the background
    arrivals, windows, ttfts = [], [], []
    decode = threading.Thread(target=token_times, args=(args.b, args.model, [9, 10, 11], args.stall_decode, arrivals))
    decode.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    for p in prompts:
        time.sleep(0.3)
        t0 = time.perf_counter()
        ttft, _, _ = complete(args.b, args.model, p, 1)
        windows.append((t0, time.perf_counter()))
        ttfts.append(ttft)
    decode.join()
    inside, outside = [], []
    for t_prev, t in zip(arrivals[1:], arrivals[2:]):
        gap = t - t_prev
        hit = any(t > w0 and t_prev < w1 for w0, w1 in windows)
        (inside if hit else outside).append(gap)
    ms = lambda v: f"{statistics.median(v) * 1e3:7.1f} {max(v) * 1e3:7.1f}" if v else "      -       -"
    print()
    print(f"decode on B while it loads {len(prompts)} prompts of {args.stall_tokens} tokens from A "
          f"(their TTFT median {statistics.median(ttfts):.3f} s)")
    print(f"{'token gap of the decode':<28} {'n':>4} {'p50 ms':>7} {'max ms':>7}")
    print(f"{'outside the loads':<28} {len(outside):>4} {ms(outside)}")
    print(f"{'during the loads':<28} {len(inside):>4} {ms(inside)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--stall-prompts", type=int, default=2)
    ap.add_argument("--stall-tokens", type=int, default=1000)
    ap.add_argument("--stall-decode", type=int, default=300)
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
    if args.stall_prompts:
        decode_stall(args, random.Random(11))
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
