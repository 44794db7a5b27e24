"""What a running stack did over a window, read from outside: Redis' counters, its MONITOR, the
processes' CPU and the workers' engine steps.

bench.redis_cost and bench.scale_workers read a stack the same way: an INFO snapshot before and
after a crowd (commands by name, those run inside Lua scripts included, as Redis counts them;
bytes; Redis' CPU), the CPU each role's processes spent, and, under MONITOR, who sent which
command. This script's own connections are named (ME) so that none of its commands counts as
the service's.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import psutil
import redis

from bench.stack import Stack


ME = "redis-cost"  # this script's own connections, named so that MONITOR's counts leave them out
# Commands this script sends to measure (INFO, CLIENT LIST...): never counted as the service's.
OWN = {"info", "config|resetstat", "client|list", "client|setname", "monitor", "echo", "hello",
       "script|load", "command|docs", "select"}
STOP_MARK = "redis-cost-stop"


def _lua_scripts() -> dict[str, str]:
    """Every Lua script of the service, by name (_TAKE -> take): MONITOR shows only their SHA."""
    import api.admission
    import api.batch_store
    import worker.job_queue
    found = {}
    for module in (api.admission, api.batch_store, worker.job_queue):
        for name, value in vars(module).items():
            if name.startswith("_") and name.isupper() and isinstance(value, str) and "redis.call" in value:
                found[name.strip("_").lower()] = value
    return found


SCRIPTS = _lua_scripts()
SCRIPT_BY_SHA = {hashlib.sha1(text.encode()).hexdigest(): name for name, text in SCRIPTS.items()}


# Reading Redis' own counters

def snapshot(client: redis.Redis) -> dict:
    info = client.execute_command("INFO", "commandstats", "stats", "cpu", "memory")
    calls, usec = {}, {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            name = key.removeprefix("cmdstat_")
            if name not in OWN:
                calls[name], usec[name] = int(value["calls"]), int(value["usec"])
    return {"calls": calls, "usec": usec, "net_in": int(info["total_net_input_bytes"]),
            "net_out": int(info["total_net_output_bytes"]),
            "cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "memory": int(info["used_memory"]), "at": time.perf_counter()}


def delta(before: dict, after: dict, info_bytes: int = 0) -> dict:
    """What happened between two snapshots; `info_bytes`: one INFO reply, which is ours, not the
    service's output."""
    names = set(before["calls"]) | set(after["calls"])
    return {"calls": {n: after["calls"].get(n, 0) - before["calls"].get(n, 0) for n in sorted(names)},
            "usec": {n: after["usec"].get(n, 0) - before["usec"].get(n, 0) for n in sorted(names)},
            "net_in": after["net_in"] - before["net_in"],
            "net_out": after["net_out"] - before["net_out"] - info_bytes,
            "cpu_s": round(after["cpu_s"] - before["cpu_s"], 6),
            "memory": after["memory"] - before["memory"],
            "seconds": round(after["at"] - before["at"], 3)}


def info_reply_bytes(client: redis.Redis) -> int:
    """The bytes one of our INFO calls adds to Redis' output count."""
    first = snapshot(client)
    second = snapshot(client)
    return second["net_out"] - first["net_out"]


def less_background(measured: dict, idle: dict) -> dict:
    """`measured` less what the idle stack does in as many seconds (heartbeats, idle polls)."""
    scale = measured["seconds"] / idle["seconds"]
    out = dict(measured)
    out["calls"] = {n: max(0.0, c - idle["calls"].get(n, 0) * scale) for n, c in measured["calls"].items()}
    for key in ("net_in", "net_out", "cpu_s"):
        out[key] = max(0.0, measured[key] - idle[key] * scale)
    return out


# The processes' CPU

def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (gunicorn's master and its workers)."""
    try:
        process = psutil.Process(pid)
        total = 0.0
        for p in [process, *process.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
        return total
    except psutil.NoSuchProcess:
        return 0.0


def cpu_by_role(running: Stack) -> dict[str, float]:
    roles = {"redis": 0.0, "api": 0.0, "workers": 0.0}
    for name, process in running.processes.items():
        role = "workers" if name.startswith("worker") else name
        roles[role] = roles.get(role, 0.0) + cpu_seconds(process.pid)
    mine = os.times()
    roles["client"] = mine.user + mine.system  # this process: the crowd's HTTP clients
    return roles


def worker_steps(ports: list[int]) -> int:
    """Engine steps so far, summed over the workers (their batch-size histogram's count)."""
    total = 0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("storyteller_batch_size_count"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


# Who sent what: MONITOR

class Monitor(threading.Thread):
    """Counts every command Redis runs, by who sent it: the connection's port (told apart later by
    the connections' names), or, for a command a Lua script ran (no round trip of its own), the
    script: Redis runs one command at a time, so a script's commands follow its EVALSHA."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, client_name=f"{ME}-monitor")
        self.counts: dict[tuple[str, str], int] = {}  # (port or "script:NAME", command) -> calls
        self.ready = threading.Event()

    def run(self) -> None:
        script = "?"
        with self.client.monitor() as monitor:
            self.ready.set()
            for entry in monitor.listen():
                words = entry["command"].split(" ", 2)
                if entry["command"].startswith("ECHO") and STOP_MARK in entry["command"]:
                    return
                name = words[0].lower()
                if name in ("evalsha", "eval") and len(words) > 1:
                    sha = words[1] if name == "evalsha" else hashlib.sha1(words[1].encode()).hexdigest()
                    script = SCRIPT_BY_SHA.get(sha, "other")
                    name = f"evalsha:{script}"
                sender = f"script:{script}" if entry["client_type"] == "lua" else entry["client_port"]
                self.counts[(sender, name)] = self.counts.get((sender, name), 0) + 1


def monitored(client: redis.Redis, url: str, crowd: Callable[[], dict]) -> tuple[dict, dict]:
    """Run `crowd` under MONITOR: ({"api:get": n, "worker:evalsha:take": n, "script:take:lindex": n,
    ..., "seconds": s}, the crowd's row)."""
    monitor = Monitor(url)
    monitor.start()
    monitor.ready.wait(5)
    time.sleep(0.2)
    started = time.perf_counter()
    row = crowd()
    seconds = time.perf_counter() - started
    names = {}
    for entry in client.client_list():
        names[entry["addr"].rsplit(":", 1)[1]] = entry.get("name", "")
    client.echo(STOP_MARK)
    monitor.join(60)
    counts: dict[str, float] = {}
    for (sender, command), n in monitor.counts.items():
        if command in OWN:
            continue
        if sender.startswith("script:"):
            side = sender
        else:
            name = names.get(sender, "")
            if name.startswith(ME):
                continue
            side = "api" if name.startswith("storyteller-api") else "worker" if name == "" else "other"
        counts[f"{side}:{command}"] = counts.get(f"{side}:{command}", 0) + n
    counts["seconds"] = seconds
    return counts, row


def is_round_trip(sent: str) -> bool:
    """A command a client sent ("api:get"), not one a script ran ("script:take:lindex")."""
    return not sent.startswith("script:")


# The model and the machine a stack ran on

def tiny_model(directory: Path) -> str:
    """The tests' tiny random Llama, with room for long answers (rotary positions: no weight
    depends on the context length, so raising it in the config is all it takes)."""
    from tests.tiny_models import save_tiny
    path = save_tiny("llama", str(directory / "tiny-llama"))
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 2048
    config_path.write_text(json.dumps(config, indent=2))
    return path


def less_idle(senders: dict, idle: dict) -> dict:
    """A monitored crowd's counts less what the idle stack sends in as many seconds."""
    background = senders["seconds"] / idle["seconds"]
    return {k: (v if k == "seconds" else round(max(0.0, v - idle.get(k, 0) * background), 1))
            for k, v in senders.items()}


def machine() -> dict:
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "redis": version.split(" sha=")[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
