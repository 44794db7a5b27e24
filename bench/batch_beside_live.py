"""Do live players keep their latency while a batch runs? The ratio tests/test_batch_service.py
used to assert (median within 2x), measured here instead: a ratio of times on a shared machine is
a measurement, not a pass/fail.

A player sends `--requests` alike requests one after another, alone; then a batch of `--lines`
requests goes in, and once its first answer is in the player sends as many again. Both phases run
in one run against one stack, so the ratio (beside / alone) compares like with like.

    python -m bench.batch_beside_live --requests 15        # its own stack: API, a SmolLM2 worker, the batch worker
    python -m bench.batch_beside_live --url http://127.0.0.1:8000/v1   # a running one (`python -m batch` too)

Prints a table (median, p95 and count of each phase, and their ratios), writes <out>.json and
<out>.png (the two latency distributions).
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai

from bench.client import get_first_model
from bench.probes import machine
from bench.report import cell, pyplot, save_figure, write_json
from bench.stack import Stack, stop
from bench.stats import p95, ratio
from shared.lifetime import dies_with_parent

PHASES = ("alone", "beside batch")
PROMPT = "The player asks the innkeeper"


@contextmanager
def own_stack(model: str, batch_concurrency: int, logs: Path):
    """A private stack (bench.stack: Redis, the API, one worker) plus RQ's batch worker. The API
    and the batch worker share a files directory (FILES_DIR), as they would share a volume."""
    with tempfile.TemporaryDirectory() as files_dir:
        running = Stack({"FILES_DIR": files_dir, "BATCH_CONCURRENCY": batch_concurrency}, model, logs,
                        "batch-beside-live")
        batch = None
        try:
            running.start()
            log = running.log_dir / "batch-beside-live-batch.log"
            with open(log, "wb") as out:  # Stack starts no batch worker: started here, on its env
                batch = subprocess.Popen([sys.executable, "-m", "batch"], env=dict(running.env, API_URL=running.url),
                                         stdout=out, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
            yield running.url
        finally:
            stop(batch)  # before the API it sends to
            running.close()


def latencies(client, model: str, count: int, tokens: int) -> list[float]:
    """A player's requests, one after another (a player waits for its answer): seconds each took.
    ignore_eos makes every answer exactly `tokens` long, so the requests are alike."""
    took = []
    for _ in range(count):
        began = time.monotonic()
        client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
        took.append(time.monotonic() - began)
    return took


def measure(url: str, model: str, args) -> dict:
    client = openai.OpenAI(base_url=url, api_key=args.api_key, timeout=args.timeout)
    latencies(client, model, 3, args.tokens)  # warm: the API's tokenizer cache, the worker's first steps
    alone = latencies(client, model, args.requests, args.tokens)
    lines = [{"custom_id": f"lore-{i:03d}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"The legend of place {i}", "max_tokens": args.line_tokens,
                       "ignore_eos": True}} for i in range(args.lines)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("lore.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    try:
        # Its first answer in: the batch is really running (the RQ worker took it) before we measure.
        deadline = time.monotonic() + args.timeout
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            if time.monotonic() > deadline:
                raise SystemExit(f"no answer from the batch within {args.timeout:g} s: is `python -m batch` running?")
            time.sleep(0.2)
        before = client.batches.retrieve(batch.id).request_counts.completed
        beside = latencies(client, model, args.requests, args.tokens)
        after = client.batches.retrieve(batch.id)
    finally:
        client.batches.cancel(batch.id)  # the rest of it is no measurement: free the machine
    phases = {name: {"count": len(values), "median_s": round(statistics.median(values), 4),
                     "p95_s": round(p95(values), 4), "latencies_s": [round(v, 4) for v in values]}
              for name, values in zip(PHASES, (alone, beside))}
    return {
        "model": model, "requests": args.requests, "tokens": args.tokens, "lines": args.lines,
        "line_tokens": args.line_tokens, "batch_concurrency": args.batch_concurrency if not args.url else None,
        "phases": phases,
        "median_ratio": round(ratio(phases["beside batch"]["median_s"], phases["alone"]["median_s"]), 3),
        "p95_ratio": round(ratio(phases["beside batch"]["p95_s"], phases["alone"]["p95_s"]), 3),
        # Did the batch go on beside every live request? If it ended first, "beside" was partly alone.
        "batch_lines_answered_beside": after.request_counts.completed - before,
        "batch_ran_throughout": after.status == "in_progress",
        "machine": machine(),
    }


def table(result: dict) -> str:
    rows = [f"{'':<14}{'median s':>10}{'p95 s':>10}{'count':>7}"]
    for name in PHASES:
        p = result["phases"][name]
        rows.append(f"{name:<14}{cell(p['median_s'], '.3f'):>10}{cell(p['p95_s'], '.3f'):>10}{p['count']:>7}")
    rows.append(f"{'beside/alone':<14}{cell(result['median_ratio'], '.2f') + 'x':>10}"
                f"{cell(result['p95_ratio'], '.2f') + 'x':>10}")
    ran = "still running at the end" if result["batch_ran_throughout"] else "ENDED before the player"
    rows.append(f"batch: {result['batch_lines_answered_beside']} of {result['lines']} lines answered beside "
                f"the player; {ran}")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    """Each phase's latencies in the order sent (a drift shows) and as a distribution (sorted)."""
    plt = pyplot()
    fig, (ax_seq, ax_cdf) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    for name in PHASES:
        values = result["phases"][name]["latencies_s"]
        ax_seq.plot(range(1, len(values) + 1), values, "o-", label=name)
        ordered = sorted(values)
        ax_cdf.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                    label=f"{name} (median {result['phases'][name]['median_s']:.3f} s)")
    ax_seq.set(title="Each request, in the order sent", xlabel="request", ylabel="seconds")
    ax_cdf.set(title="Distribution", xlabel="seconds", ylabel="fraction of requests within")
    for ax in (ax_seq, ax_cdf):
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_seq.set_ylim(bottom=0)
    fig.suptitle(f"A live player ({result['tokens']} tokens a request) alone and beside a batch of "
                 f"{result['lines']} x {result['line_tokens']} tokens: median x{result['median_ratio']:.2f}")
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running API (and batch worker); default: start a stack of our own")
    ap.add_argument("--stack-model", default="smollm2", help="the own stack's worker model")
    ap.add_argument("--batch-concurrency", type=int, default=2,
                    help="the own stack's batch worker: batch requests at once (the test's 2)")
    ap.add_argument("--model", default=None, help="default: the API's first model")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--requests", type=int, default=30, help="a phase's requests")
    ap.add_argument("--tokens", type=int, default=16, help="tokens of each live request")
    ap.add_argument("--lines", type=int, default=50, help="the batch's requests")
    ap.add_argument("--line-tokens", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request, and for the batch to start")
    ap.add_argument("--out", default="bench/results/batch-beside-live", help="writes <out>.json and <out>.png")
    ap.add_argument("--logs", default="bench/results/logs")
    args = ap.parse_args(argv)
    with ExitStack() as stack:
        url = args.url or stack.enter_context(own_stack(args.stack_model, args.batch_concurrency, Path(args.logs)))
        result = measure(url, args.model or get_first_model(url), args)
    print(table(result))
    out = Path(args.out)
    write_json(out.with_suffix(".json"), result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
