"""Throughput with 1, 2 and 3 workers of one model, and where the limit is: Redis, the API or the CPUs.

    python -m bench.scale_workers --out docs/results/scale-workers                     # the tiny model: 1, 2, 3
    python -m bench.scale_workers --out docs/results/scale-workers --model smollm2 --workers 1 2

Each configuration gets a private stack (bench.stack: redis-server, the API, N workers of the model)
and the same crowd (--players x --requests completions of exactly --tokens tokens). While the crowd
runs it records the tokens/s, what each process spent in CPU (Redis, the API, the workers, this
process's HTTP clients) and what the whole machine did (other people's work included), and Redis'
commands per generated token (INFO commandstats, those run inside Lua scripts included).

Workers are pinned with taskset while the cores allow one group each (N <= cores: worker i gets the
i-th of N equal groups, and TORCH_THREADS its size); with more workers than cores they float, a
thread each. Results go to <out>.json (re-running a model replaces its rows) and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import psutil
import redis

from bench.load import run_crowd
from bench.probes import ME, cpu_by_role, delta, info_reply_bytes, machine, snapshot, tiny_model, worker_steps
from bench.report import pyplot, save_figure, write_json
from bench.stack import StackError, stack
from serve import free_port

ROLES = ("redis", "api", "workers", "client")


def placement(workers: int, cores: list[int], tiny: bool) -> tuple[list[str], list[int]]:
    """taskset CPU lists (empty: not pinned) and TORCH_THREADS, per worker."""
    if workers > len(cores):  # no core of its own for each: they float, a thread each
        return [], [1] * workers
    size = len(cores) // workers
    groups = [cores[i * size:(i + 1) * size] for i in range(workers)]
    # The tiny model gains nothing from a second thread (its matrices are 32 wide).
    return [",".join(map(str, g)) for g in groups], [1 if tiny else len(g) for g in groups]


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, all CPU seconds) of the whole machine so far, every process's."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


def run_config(args, model_path: str, label: str, workers: int, say) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    pin, threads = placement(workers, cores, args.model == "tiny")
    ports = [free_port() for _ in range(workers)]
    env = dict(item.split("=", 1) for item in args.env)
    worker_env = [{"METRICS_PORT": port, "TORCH_THREADS": env.get("TORCH_THREADS", t)}
                  for port, t in zip(ports, threads)]
    with stack(env, model_path, Path(args.logs), f"scale-{label}-{workers}", workers=workers, pin=pin,
               worker_env=worker_env) as running:
        client = redis.Redis.from_url(running.redis_url, client_name=ME)
        run_crowd(running.url, running.model, 2 * workers, 1, 8, progress=False, stream=args.stream)
        info_bytes = info_reply_bytes(client)
        cpu0, steps0, busy0 = cpu_by_role(running), worker_steps(ports), machine_busy()
        before = snapshot(client)
        row = run_crowd(running.url, running.model, args.players, args.requests, args.tokens,
                        progress=False, stream=args.stream, timeout=args.timeout)
        redis_delta = delta(before, snapshot(client), info_bytes)
        cpu1, steps1, busy1 = cpu_by_role(running), worker_steps(ports), machine_busy()
    seconds = row["seconds"]
    cores_used = {role: round((cpu1[role] - cpu0[role]) / seconds, 3) for role in ROLES}
    machine_cores = (busy1[0] - busy0[0]) / seconds
    commands = sum(redis_delta["calls"].values())
    result = {
        "model": label, "workers": workers, "pin": pin, "torch_threads": [w["TORCH_THREADS"] for w in worker_env],
        "players": args.players, "requests": row["requests"], "errors": row["errors"],
        "error_samples": row["error_samples"], "tokens": row["tokens"], "seconds": seconds,
        "tokens_per_s": row["tokens_per_s"], "median_s": row["median_s"], "p95_s": row["p95_s"],
        "ttft_median_s": row.get("ttft_median_s"), "steps": steps1 - steps0,
        "cores_used": cores_used,
        "machine_cores_busy": round(machine_cores, 3), "machine_cores": len(cores),
        "others_cores": round(max(0.0, machine_cores - sum(cores_used.values())), 3),
        "redis_commands": commands,
        "redis_commands_per_token": round(commands / row["tokens"], 3) if row["tokens"] else None,
        "redis_cpu_us_per_token": round(redis_delta["cpu_s"] * 1e6 / row["tokens"], 2) if row["tokens"] else None,
        "redis_commands_per_s": round(commands / seconds),
        "redis_calls": redis_delta["calls"],
    }
    say(line(result))
    return result


HEADER = (f"{'model':<14}{'workers':>8}{'pinned':>10}{'tok/s':>9}{'med s':>8}{'steps':>7}  "
          f"{'cores: redis':>12}{'api':>6}{'workers':>8}{'client':>7}{'others':>7}{'all':>6}  "
          f"{'cmd/tok':>8}{'redis us/tok':>13}")


def line(r: dict) -> str:
    c = r["cores_used"]
    return (f"{r['model']:<14}{r['workers']:>8}{' '.join(r['pin']) or '-':>10}{r['tokens_per_s'] or 0:>9.1f}"
            f"{r['median_s'] or 0:>8.2f}{r['steps']:>7}  {c['redis']:>12.2f}{c['api']:>6.2f}{c['workers']:>8.2f}"
            f"{c['client']:>7.2f}{r['others_cores']:>7.2f}{r['machine_cores_busy']:>6.2f}  "
            f"{r['redis_commands_per_token'] or 0:>8.2f}{r['redis_cpu_us_per_token'] or 0:>13.1f}"
            + (f"  {r['errors']} ERRORS" if r["errors"] else ""))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5), layout="constrained")
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        axes[0].plot([r["workers"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=model)
        axes[2].plot([r["workers"] for r in mine], [r["redis_commands_per_token"] for r in mine], "o-",
                     label=model)
    axes[0].set(title="Throughput", xlabel="workers", ylabel="generated tokens / s (log)")
    axes[0].set_yscale("log")  # a tiny model and a real one: thousands and tens of tokens/s
    axes[2].set(title="Redis commands per generated token", xlabel="workers", ylabel="commands / token")
    axes[2].set_ylim(bottom=0)
    for ax in (axes[0], axes[2]):
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend()
    labels = [f"{r['model'].replace('-135M-Instruct', '')} x{r['workers']}" for r in rows]
    bottom = [0.0] * len(rows)
    for role in (*ROLES, "others"):
        values = [r["others_cores"] if role == "others" else r["cores_used"][role] for r in rows]
        axes[1].bar(labels, values, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    if rows:
        axes[1].axhline(rows[0]["machine_cores"], color="black", ls="--", lw=1, label="the machine's cores")
    axes[1].set(title="Where the CPU went during the crowd", ylabel="cores busy (CPU s / wall s)")
    axes[1].tick_params(axis="x", labelsize=8, labelrotation=35)
    axes[1].legend(fontsize=8)
    crowd = {f"{r['players']} players, {r['requests']} requests of {r['tokens'] // max(1, r['requests'])} tokens"
             for r in rows}
    fig.suptitle("Storyteller: throughput by worker count (" + "; ".join(sorted(crowd)) + ")")
    save_figure(fig, path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/scale-workers", help="writes <out>.json and <out>.png")
    ap.add_argument("--model", default="tiny", help="'tiny' (the tests' random Llama), 'smollm2', or a directory")
    ap.add_argument("--label", help="the model's name in the report (default: from --model)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--players", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per player")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="worker settings")
    ap.add_argument("--logs", default="bench/results/logs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    json_path = out.with_suffix(".json")
    label = args.label or ("tiny-llama" if args.model == "tiny" else Path(args.model).name)
    report = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    report["rows"] = [r for r in report["rows"] if r["model"] != label]
    report.setdefault("machines", {})[label] = machine()

    def save() -> None:
        write_json(json_path, report, indent=1)

    print(f"# {label}: {args.players} players x {args.requests} requests x {args.tokens} tokens, "
          f"{'streamed' if args.stream else 'whole'}; workers {', '.join(map(str, args.workers))}")
    print(HEADER, flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_path = tiny_model(Path(tmp)) if args.model == "tiny" else args.model
        for workers in args.workers:
            try:
                report["rows"].append(run_config(args, model_path, label, workers,
                                                 lambda text: print(text, flush=True)))
            except StackError as exc:
                failed += 1
                print(f"{label} x {workers}: the stack did not start: {exc}", file=sys.stderr)
            save()
    plot(report["rows"], out.with_suffix(".png"))
    print(f"wrote {json_path} and {out.with_suffix('.png')}")
    return 1 if failed or any(r["errors"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
