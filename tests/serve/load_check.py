"""Load check: N concurrent streamed requests against ``python -m specter.serve`` (default 20, the
bundled model), each text compared with ``python -m specter.run``'s greedy text for the same
prompt, the server's resident memory measured before and after (two rounds, so growth shows).

Run from the repository root: ``python tests/serve/load_check.py [--requests 20] [--rounds 2]``.
Prints a JSON summary; exits 1 when a text differs or a request fails. Talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/quickstart.yaml"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reference_texts(n: int, max_tokens: int) -> tuple[list[str], list[str]]:
    """``n`` evaluation prompts (the file's, cycled) and specter.run's greedy texts for them."""
    lines = (ROOT / "recipes/prompts/eval.jsonl").read_text().splitlines()
    distinct = min(n, len(lines))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        subprocess.run([sys.executable, "-m", "specter.run", RECIPE, "--set", f"max_prompts={distinct}", "--set",
                        f"max_new_tokens={max_tokens}", "--report", str(report), "--quiet"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outputs = json.loads(report.read_text())["outputs"]
    prompts = [json.loads(line)["prompt"] for line in lines[:distinct]]
    texts = [o["text"].removesuffix("<|endoftext|>") for o in outputs]
    return [prompts[i % distinct] for i in range(n)], [texts[i % distinct] for i in range(n)]


def one_round(client, prompts: list[str], max_tokens: int) -> tuple[float, list[dict]]:
    results = [dict() for _ in prompts]

    def run(index: int) -> None:
        out = results[index]
        out["text"], out["chunks"] = "", 0
        try:
            stream = client.completions.create(model="bundled:tiny-moe", prompt=prompts[index], max_tokens=max_tokens,
                                               temperature=0, stream=True)
            for chunk in stream:
                out["chunks"] += 1
                if chunk.choices:
                    out["text"] += chunk.choices[0].text
        except Exception as error:  # noqa: BLE001 - reported
            out["error"] = repr(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return time.perf_counter() - started, results


def main() -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    prompts, expected = reference_texts(args.requests, args.max_tokens)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "specter.serve", RECIPE, "--port", str(port),
                               "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.25)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        client.completions.create(model="bundled:tiny-moe", prompt="warm up", max_tokens=4)
        summary = {"requests": args.requests, "max_tokens": args.max_tokens, "rss_mib_before": rss_mib(server.pid),
                   "rounds": []}
        ok = True
        for _ in range(args.rounds):
            wall, results = one_round(client, prompts, args.max_tokens)
            wrong = [i for i, (r, e) in enumerate(zip(results, expected)) if r.get("error") or r["text"] != e]
            ok = ok and not wrong
            time.sleep(0.5)
            summary["rounds"].append({
                "wall_s": round(wall, 2), "correct": args.requests - len(wrong), "wrong": wrong,
                "errors": [r["error"] for r in results if r.get("error")],
                "min_chunks": min(r["chunks"] for r in results), "rss_mib_after": rss_mib(server.pid)})
        metrics = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        summary["metrics"] = [line for line in metrics.splitlines()
                              if line.startswith(("specter_requests_total", "specter_queue_depth", "specter_busy"))]
        print(json.dumps(summary, indent=2))
        return 0 if ok else 1
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
