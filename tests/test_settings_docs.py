"""The settings table (docs/settings.md, which the README links to) and --help come from one source,
the settings' own definitions (shared/settings.py), so they cannot disagree: the table there is the one
`python -m shared.settings --markdown` renders, and --help shows each default as the table does."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

from shared.settings import DOCUMENTED, Settings, settings_table
from shared.settings import README_END as END, README_START as START, SETTINGS_PAGE
from tests.processes import ROOT
from worker.faults import Faults


def readme_table() -> str:
    text = (ROOT / SETTINGS_PAGE).read_text()
    return text[text.index(START) + len(START):text.index(END)]


def clean_env() -> dict:
    """This machine's environment without any setting in it: --help then shows the defaults."""
    names = {Settings.env_name(f.name) for f in fields(Settings)} | {"WORKERS"}
    return {k: v for k, v in os.environ.items() if k not in names}


def table_rows(table: str) -> dict[str, list[str]]:
    """Env variable -> its row's cells, backticks dropped (escaped pipes kept in their cell)."""
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip().strip("`") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = cells
    return rows


def test_the_readme_table_is_the_rendered_one():
    assert readme_table() == settings_table(DOCUMENTED), \
        f"{SETTINGS_PAGE}'s settings table is stale: run .venv/bin/python -m shared.settings --update-readme"


def test_the_regeneration_command_prints_that_table():
    done = subprocess.run([sys.executable, "-m", "shared.settings", "--markdown"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == readme_table()


def test_the_update_command_writes_the_table_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{START}| a stale table |\n{END}\n\nmore text\n")
    done = subprocess.run([sys.executable, "-m", "shared.settings", "--update-readme", str(readme)], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert readme.read_text() == f"# Title\n\n{START}{settings_table(DOCUMENTED)}{END}\n\nmore text\n"


FAULTS = [f.name for f in fields(Faults)]  # the tests' fault injection: not settings (worker/faults.py)


def test_every_setting_is_documented_and_no_fault_is_one():
    rows = table_rows(readme_table())
    assert set(rows) == {Settings.env_name(name) for name in DOCUMENTED}
    for name in ("heartbeat_s", "heartbeat_ttl_s", "answer_ttl_s", "metrics_host"):
        assert Settings.env_name(name) in rows
    for name in FAULTS:
        assert name.upper() not in rows and name not in DOCUMENTED


def test_help_shows_every_default_as_the_readme_does():
    """serve.sh's --help (serve.py: every setting) says `(env NAME, default VALUE)` with the table's
    VALUE: booleans as 1/0, as the environment takes them, not Python's True/False."""
    done = subprocess.run([sys.executable, "serve.py", "--help"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = " ".join(done.stdout.split())  # argparse wraps lines at spaces
    for env, flag, default, _ in table_rows(readme_table()).values():
        assert f"{flag} " in shown and f"(env {env}, default {default})" in shown, env
    assert "False" not in shown and "True" not in shown
    for name in FAULTS:
        assert "--" + name.replace("_", "-") not in shown
