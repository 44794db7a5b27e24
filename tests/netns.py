"""Hosts on one machine, for tests that cut a host's network link: Linux network namespaces.

A `Network` is a switch (a Linux bridge in a namespace of its own) and one namespace per host, each
joined to the switch by a veth pair and given an address in a private /24 that nothing else on the
machine uses. The test process, in the root namespace, is one more host on the switch (its own veth
and address), so a test's clients and its Redis client reach the services at their addresses, and
all of that traffic crosses the veths; a service bound to its namespace's address is reachable from
nowhere else.

`cut(host)` sets the host's port on the switch down, as a pulled cable: the host's side keeps its
address and its TCP connections, but nothing gets through, so they stall (no RST, no error) until
a timeout of the host's own notices; `restore(host)` plugs it back in, and those connections go on.

Every process is started with `ip netns exec NS ...`; `close()` (also on failure) stops them, then
kills by pid whatever is still inside the namespaces (a gunicorn worker whose master was killed),
then deletes the namespaces, which removes the veths, the root one included. Namespaces are named
after the test process's pid, so one left by a test killed outright (SIGKILL gives no time to clean
up; its processes die with it, PR_SET_PDEATHSIG) is deleted by the next run.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests import processes

PREFIX = "storyteller-netns"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-")
PR_SET_PDEATHSIG = 1
# Looked up now, not in the forked child, where another thread may hold a lock dlopen needs.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def unavailable() -> Optional[str]:
    """Why namespaces can't be made here (None: they can): the test's skip reason (a failure in CI,
    tests/allowed_skips.py: test.sh installs iproute2, and CI runs as root)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed (test.sh installs it)"
    probe = f"{PREFIX}-{os.getpid()}-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> str:
    """Run `ip ARGS`; an error names the command and what ip said."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    name: str  # also its port's name on the switch (at most 15 characters)
    namespace: str
    address: str


class Network:
    """A switch and one namespace per host name; use as a context manager (or call close())."""

    def __init__(self, hosts: list[str], log_dir: Path):
        self.log_dir = Path(log_dir)
        self.processes: list[subprocess.Popen] = []
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._tag = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        _remove_stale()
        try:
            self.subnet = _free_subnet()
            addresses = self.subnet.hosts()
            self.address = str(next(addresses))  # the test process's own
            self.switch = self._namespace("switch")
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for name in hosts:
                self.hosts[name] = self._plug(name, str(next(addresses)))
            # The root namespace's end: created here, its peer put straight into the switch, so only
            # this one name has to be free in the root namespace.
            self.root_link = f"st{uuid.uuid4().hex[:8]}"
            ip("link", "add", self.root_link, "type", "veth", "peer", "name", "test", "netns", self.switch)
            ip("-n", self.switch, "link", "set", "test", "master", "br0", "up")
            ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
        except BaseException:
            self.close()
            raise

    def _namespace(self, name: str) -> str:
        namespace = f"{self._tag}-{name}"
        ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
        return namespace

    def _plug(self, name: str, address: str) -> Host:
        namespace = self._namespace(name)
        # Made inside the switch's namespace, the peer moved straight into the host's: no veth name
        # ever exists in the root namespace, where another run could hold it.
        ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("-n", self.switch, "link", "set", name, "master", "br0", "up")
        ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        return Host(name, namespace, address)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Links

    def cut(self, host: str) -> None:
        """Pull the host's cable at the switch: its connections stall, nothing gets an error."""
        ip("-n", self.switch, "link", "set", host, "down")

    def restore(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", host, "up")

    # Processes

    def start(self, host: str, argv: list[str], name: str, **env) -> subprocess.Popen:
        """`argv` inside the host's namespace (`ip netns exec` execs it: the pid is argv's own), from
        the repository root, with the tests' clean environment; output in log_dir/name.{out,err}."""
        out_path, err_path = self.log_dir / f"{name}.out", self.log_dir / f"{name}.err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].namespace, *argv],
                                    cwd=processes.ROOT, env=processes._env(**env), stdout=out, stderr=err,
                                    preexec_fn=_die_with_parent)
        proc.log_files = (out_path, err_path)  # as tests.processes.logs() reads them
        self.processes.append(proc)
        return proc

    def python(self, host: str, module_args: list[str], name: str, **env) -> subprocess.Popen:
        """`python -m ...` (this interpreter, the venv's) inside the host's namespace."""
        return self.start(host, [sys.executable, "-m", *module_args], name, **env)

    # Clean-up

    def close(self) -> None:
        """Stop every process, then delete every namespace; each step runs even if one before failed."""
        for host in self.hosts:  # a stopping worker behind a cut link would wait for its Redis
            try:
                self.restore(host)
            except RuntimeError:
                pass
        for proc in self.processes:
            if proc.poll() is None:
                _resume(proc)  # a test may have stopped it (SIGSTOP): SIGTERM must reach it
            processes.stop(proc, timeout=10)
        for namespace in self._namespaces:
            _kill_inside(namespace)
        # The host namespaces first: each takes its veth pair with it; then the switch, with the
        # root namespace's pair.
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces = []
        if getattr(self, "root_link", None):
            subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of the root namespace overlaps (another run's,
    a VPN's, a container network's)."""
    used = []
    for line in ip("-4", "-o", "addr", "show").splitlines():
        match = re.search(r"inet (\S+)", line)
        if match:
            used.append(ipaddress.ip_interface(match.group(1)).network)
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("broadcast", "local", "unreachable", "prohibit", "blackhole"):
            first = line.split()[1]
        try:
            used.append(ipaddress.ip_network(first, strict=False))
        except ValueError:  # "default" and the like
            continue
    rng = random.Random(os.getpid() ^ uuid.uuid4().int)
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{rng.randrange(64, 250)}.{rng.randrange(256)}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise RuntimeError("no free /24 in 10.0.0.0/8 for the test network")


def _die_with_parent() -> None:
    # Runs in the child before exec (ip, then the program ip execs, keep it): if the test process is
    # killed outright, its services go with it instead of holding a namespace forever.
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _resume(proc: subprocess.Popen) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _kill_inside(namespace: str) -> None:
    """SIGKILL, by pid, whatever still runs inside one of this network's namespaces: only this
    network's own processes (and their children) ever ran there."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_stale() -> None:
    """Delete the namespaces of earlier runs whose test process is gone and which hold no process."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        namespace = line.split()[0] if line.split() else ""
        match = _NAME.match(namespace)
        if not match or _alive(int(match.group(1))):
            continue
        held = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        if not held.stdout.split():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
