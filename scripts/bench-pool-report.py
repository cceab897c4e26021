import glob, json, re, sys
out = sys.argv[1]
runs = open(f"{out}/runs").read().split()
def prom(path, name):
    v = {}
    try:
        for line in open(path):
            m = re.match(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                v[m.group(1) or ""] = float(m.group(2))
    except FileNotFoundError:
        pass
    return v
def per_second(samples, hosts, way):
    """Bytes per second the hosts' links carried (way 0: sent by the hosts, 1: received)."""
    v = []
    for a, b in zip(samples, samples[1:]):
        dt = max(b["t"] - a["t"], 1e-3)
        v.append(sum(b["bytes"][h][way] - a["bytes"][h][way] for h in hosts) / dt)
    return v
def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else 0.0
mb = lambda b: b / 1e6
print("| run | reuse online | reuse simulated (seeds 1-3) | online of limit | prompt tokens computed | TTFT p50/p99 ms | ITL p50/p99 ms | paths compute/local/fabric/pull | pulled between workers, MB | fabric → workers, MB (p99/peak MB/s) | busiest worker link, MB (peak MB/s) |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |")
fabric_hosts, worker_hosts = ["h9", "h10"], ["h11", "h12", "h13", "h14"]
measured = {}
for r in runs:
    on = json.load(open(f"{out}/{r}.online.json"))
    sims = [json.load(open(p))["runs"][0] for p in sorted(glob.glob(f"{out}/{r}.sim*.json"))]
    sim = sum(s["reuse"] for s in sims) / len(sims)
    seeds = ", ".join("%.3f" % s["reuse"] for s in sims)
    lim = on["limit"]["reused_tokens"] / on["limit"]["tokens"]
    computed = on["prompt_tokens"] - on["cached_tokens"]
    before = prom(f"{out}/{r}.frontend-before.prom", "kvfabric_router_path_total")
    after = prom(f"{out}/{r}.frontend.prom", "kvfabric_router_path_total")
    p = "/".join(str(int(after.get(f'{{path="{k}"}}', 0) - before.get(f'{{path="{k}"}}', 0))) for k in ("compute", "local", "fabric", "pull"))
    pulled = sum(sum(prom(f"{out}/{r}.{w}.prom", "kvfabric_peer_pulled_bytes_total").values()) for w in ("w1", "w2", "w3", "w4"))
    samples = [json.loads(l) for l in open(f"{out}/{r}.links.jsonl")]
    total = lambda hs, way: sum(samples[-1]["bytes"][h][way] - samples[0]["bytes"][h][way] for h in hs)
    onboard = per_second(samples, fabric_hosts, 0)
    measured[r] = (q(onboard, 0.99), max(onboard, default=0.0))
    busiest = max(worker_hosts, key=lambda h: total([h], 0) + total([h], 1))
    both = [x + y for x, y in zip(per_second(samples, [busiest], 0), per_second(samples, [busiest], 1))]
    wtot = total([busiest], 0) + total([busiest], 1)
    print(f"| {r} | {on['reuse']:.3f} | {sim:.3f} ({seeds}) | {on['reuse'] / lim:.3f} (limit {lim:.3f}) | {computed} | {on['ttft_ms'][0]:.0f}/{on['ttft_ms'][2]:.0f} | {on['itl_ms'][0]:.1f}/{on['itl_ms'][2]:.1f} | {p} | {mb(pulled):.0f} | {mb(total(fabric_hosts, 0)):.0f} ({mb(measured[r][0]):.0f}/{mb(measured[r][1]):.0f}) | {busiest} {mb(wtot):.0f} ({mb(max(both, default=0)):.0f}) |")
try:
    plan = json.load(open(f"{out}/plan.json"))
except FileNotFoundError:
    sys.exit(0)
p99, peak = plan["pool_onboard_gbps"]
print()
print(f"plan --trace predicts the pool's hits onboard {p99 * 1e3:.0f} MB/s at p99 over seconds and {peak * 1e3:.0f} MB/s at peak (a pool of {plan['restore_pool_tokens']} tokens, reuse {plan['restore_pool_reuse']:.3f}).")
for r, (m99, mpeak) in measured.items():
    if r == "per-worker":
        continue
    err = lambda pred, real: (pred - real) / real * 100 if real > 0 else float("nan")
    sims = [json.load(open(p))["runs"][0] for p in sorted(glob.glob(f"{out}/{r}.sim*.json"))]
    s99 = sum(s["p99_bytes_per_s"]["onboard_g4"] for s in sims) / len(sims)
    speak = sum(s["peak_bytes_per_s"]["onboard_g4"] for s in sims) / len(sims)
    print(f"- {r}: measured fabric → workers {m99 / 1e6:.0f} MB/s p99, {mpeak / 1e6:.0f} MB/s peak; "
          f"the planner's error {err(p99 * 1e9, m99):+.0f}% at p99, {err(peak * 1e9, mpeak):+.0f}% at peak; "
          f"the simulator of this very configuration (bench trace) {s99 / 1e6:.0f}/{speak / 1e6:.0f} MB/s: "
          f"{err(s99, m99):+.0f}%, {err(speak, mpeak):+.0f}%")
