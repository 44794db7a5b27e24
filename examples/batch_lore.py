"""Background lore for a nanoMMO, written by Storyteller's batch API while players play.

    ./serve.sh                                   # in another terminal (it starts the batch worker too)
    python examples/batch_lore.py --url http://127.0.0.1:8000/v1 --requests 20

Writes a JSONL of requests (one legend per place), uploads it, starts a batch, polls it until it is
done, then prints each legend by its custom_id. The batch's requests wait behind every live player
(they run at the lowest priority), so this may take a while on a busy server; Ctrl-C cancels it.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import openai

PLACES = ["the Ruined Keep", "Dragonmere", "the Whispering Forest", "Gate of Bones", "the Sunken Library",
          "Potion Row", "the Wizard's Tower", "Goldfall Mine", "the Salt Road", "Ember Hollow"]
DONE = ("completed", "failed", "expired", "cancelled")


def requests_jsonl(model: str, count: int, max_tokens: int) -> bytes:
    lines = []
    for i in range(count):
        place = PLACES[i % len(PLACES)] + (f" ({i // len(PLACES) + 1})" if i >= len(PLACES) else "")
        lines.append({"custom_id": f"lore-{i:04d}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": model, "max_tokens": max_tokens, "messages": [
                          {"role": "user", "content": f"Tell the legend of {place} in two sentences."}]}})
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_for(client: openai.OpenAI, batch, poll_s: float):
    shown = None
    while batch.status not in DONE:
        counts = batch.request_counts
        now = (batch.status, counts.completed if counts else 0, counts.failed if counts else 0)
        if now != shown:
            print(f"  {now[0]}: {now[1]} answered, {now[2]} failed, of {counts.total if counts else '?'}", flush=True)
            shown = now
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
    return batch


def read_jsonl(client: openai.OpenAI, file_id) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API's base URL")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"),
                        help="an API key, if the server wants one (env OPENAI_API_KEY)")
    parser.add_argument("--model", help="the model (default: the first one served)")
    parser.add_argument("--requests", type=int, default=10, help="legends to write")
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the batch")
    args = parser.parse_args(argv)
    # The client's own retries (with backoff, honouring Retry-After) suit these few calls.
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, timeout=60, max_retries=5)
    model = args.model or client.models.list().data[0].id

    upload = client.files.create(file=("lore.jsonl", io.BytesIO(requests_jsonl(model, args.requests,
                                                                                args.max_tokens))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"game": "nanommo", "kind": "lore"})
    print(f"uploaded {upload.id} ({upload.bytes} bytes); batch {batch.id} for {model}", flush=True)
    try:
        batch = wait_for(client, batch, args.poll)
    except KeyboardInterrupt:
        print(f"\ncancelling {batch.id}...", flush=True)
        batch = wait_for(client, client.batches.cancel(batch.id), args.poll)

    counts = batch.request_counts
    print(f"batch {batch.id}: {batch.status}, {counts.completed} answered, {counts.failed} failed")
    for line in read_jsonl(client, batch.output_file_id):
        text = line["response"]["body"]["choices"][0]["message"]["content"]
        print(f"\n{line['custom_id']}: {text.strip()}")
    for line in read_jsonl(client, batch.error_file_id):
        why = line["error"] or line["response"]["body"].get("error", {})
        print(f"\n{line['custom_id']}: no legend ({why.get('code')}: {why.get('message')})", file=sys.stderr)
    for error in (batch.errors.data if batch.errors and batch.errors.data else []):
        print(f"batch error: {error.code}: {error.message}", file=sys.stderr)
    return 0 if batch.status == "completed" and counts.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
