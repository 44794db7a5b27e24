"""The deployment files as data, for the tests that check them (tests/test_deploy.py) and the ones
that reproduce the images without Docker (tests/test_deploy_images.py): the Dockerfiles'
instructions, the requirements they install, the dashboard's and the alert rules' queries, and
the metric names those may use (shared/metrics.py's).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from shared import metrics
from tests.processes import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU_COMPOSE = ROOT / "docker-compose.gpu.yml"
DOCKERFILES = [ROOT / "Dockerfile.api", ROOT / "Dockerfile.worker"]
PROMETHEUS = ROOT / "prometheus"
DASHBOARD = ROOT / "grafana" / "dashboards" / "storyteller.json"


# Every metric name shared/metrics.py defines (its upper-case string constants, PREFIX aside).
DEFINED = {value for name, value in vars(metrics).items()
           if name.isupper() and name != "PREFIX" and isinstance(value, str)}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC = re.compile(r"\b" + metrics.PREFIX + r"_[a-zA-Z0-9_]+")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as (KEYWORD, the rest), continuation lines joined, comments dropped."""
    found, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def cmd_of(dockerfile: Path) -> list[str]:
    cmds = [json.loads(rest) for keyword, rest in instructions(dockerfile) if keyword == "CMD"]
    assert cmds, f"{dockerfile.name} has no CMD"
    return cmds[-1]


def healthcheck_of(dockerfile: Path) -> list[str]:
    checks = [rest for keyword, rest in instructions(dockerfile) if keyword == "HEALTHCHECK"]
    assert len(checks) == 1, f"{dockerfile.name}: one HEALTHCHECK expected"
    return json.loads(checks[0].split(" CMD ", 1)[1])


def copied_folders(dockerfile: Path) -> list[str]:
    """The project's folders a Dockerfile copies into its image (its requirements files, the wheels
    and what comes from the first stage aside)."""
    return sorted(rest.split()[0] for keyword, rest in instructions(dockerfile)
                  if keyword == "COPY" and not rest.startswith(("requirements", "wheels/", "--from=")))


def requirement_lines(path: Path) -> list[str]:
    """A requirements file's requirements, the files it includes (-r) read in their place."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += requirement_lines(path.parent / line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def split_name(name: str) -> tuple[str, str]:
    """A name used in a query as (the metric shared/metrics.py defines, the suffix added to it)."""
    if name in DEFINED:
        return name, ""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] in DEFINED:
            return name[:-len(suffix)], suffix
    raise AssertionError(f"{name} is not a metric of shared/metrics.py (nor one's _bucket, _sum or _count)")


def mounts(service: dict) -> dict[str, str]:
    """A resolved service's volumes: container path -> source (an absolute host path or a volume's name)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = source
    return found
