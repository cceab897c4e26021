"""Drives kvfabric's /dashboard in Debian's Chromium (headless, through Playwright) for
cli/tests/dashboard.rs: reads one JSON command per line on stdin and answers one JSON
line on stdout. It asserts nothing itself; the Rust test compares what the page shows with
/metrics and with what it did.

    python dashboard_driver.py http://127.0.0.1:PORT

Commands:
  {"cmd": "snapshot"}            what the page shows after its next update
  {"cmd": "cachemap", "prompt": "...", "model": "..."}
                                 fills the cache map, submits, returns its rows
  {"cmd": "screenshot", "path": "..."}
  {"cmd": "quit"}
Every answer has "errors": the console errors and page errors seen so far.
"""

import json
import sys

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

READ_PAGE = """() => {
  const text = (e) => (e ? e.textContent.trim() : null);
  const rows = (sel) => [...document.querySelectorAll(sel + " tbody tr")].map((tr) => ({
    worker: tr.dataset.worker,
    state: text(tr.querySelector('[data-col="state"]')),
    role: text(tr.querySelector('[data-col="role"]')),
    requests: text(tr.querySelector('[data-col="requests"]')),
    indexed: text(tr.querySelector('[data-col="indexed"]')),
  }));
  const metrics = {};
  for (const e of document.querySelectorAll("[data-metric]")) metrics[e.dataset.metric] = text(e);
  return {
    status: text(document.querySelector("#status")),
    server: text(document.querySelector("#server")),
    metrics,
    workers: rows("#workers"),
    departed: rows("#departed"),
    fabric_shown: !document.querySelector("#fabric-box").hidden,
    fabric: [...document.querySelectorAll("#fabric tbody tr")].map((tr) => ({
      node: tr.dataset.worker,
      host: text(tr.querySelector('[data-col="host"]')),
      indexed: text(tr.querySelector('[data-col="indexed"]')),
    })),
    charts: [...document.querySelectorAll("svg.chart")].map((s) => ({
      id: s.id, lines: s.querySelectorAll("polyline").length })),
  };
}"""


def main():
    base = sys.argv[1].rstrip("/")
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(base + "/dashboard")
        page.wait_for_function("() => document.body.dataset.updated !== undefined", timeout=15000)
        print(json.dumps({"ready": True, "errors": errors}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            out = {}
            if cmd["cmd"] == "snapshot":
                before = page.evaluate("() => document.body.dataset.updated")
                page.wait_for_function(
                    "(b) => document.body.dataset.updated !== b", arg=before, timeout=15000)
                out = page.evaluate(READ_PAGE)
            elif cmd["cmd"] == "cachemap":
                page.fill("#cm-prompt", cmd["prompt"])
                if cmd.get("model"):
                    page.select_option("#cm-model", cmd["model"])
                page.evaluate("() => { document.querySelector('#cm-reason').textContent = ''; }")
                page.click("#cm-go")
                page.wait_for_function(
                    "() => document.querySelector('#cm-reason').textContent !== ''", timeout=15000)
                out = page.evaluate("""() => ({
                  reason: document.querySelector('#cm-reason').textContent,
                  rows: [...document.querySelectorAll('#cm-result tbody tr')].map((tr) => {
                    const cell = (c) => tr.querySelector(`[data-col="${c}"]`).textContent;
                    return { worker: tr.dataset.worker, chosen: tr.classList.contains('chosen'),
                             cached: cell('cached'), device: cell('device'), host: cell('host'),
                             disk: cell('disk'), remote: cell('remote') };
                  }),
                })""")
            elif cmd["cmd"] == "screenshot":
                page.screenshot(path=cmd["path"], full_page=True)
            elif cmd["cmd"] == "quit":
                break
            out["errors"] = errors
            print(json.dumps(out), flush=True)
        browser.close()


if __name__ == "__main__":
    main()
