"""Under CI a skip is a failure unless tests/allowed_skips.py lists its reason (tests/conftest.py's
hooks): checked on an inner pytest run of a few tests that skip in each way pytest allows, with and
without CI=true."""
from __future__ import annotations

import pytest

from tests import allowed_skips

pytest_plugins = ["pytester"]

SKIPPING = '''
import pytest

@pytest.fixture
def needs_a_tool():
    pytest.skip("no frobnicator installed")

def test_skips_in_its_body():
    pytest.skip("no docker engine here")

@pytest.mark.skipif(True, reason="no prometheus installed")
def test_skipped_by_a_mark():
    pass

def test_skipped_by_its_fixture(needs_a_tool):
    pass

def test_imports_what_is_missing():
    pytest.importorskip("a_module_nobody_has")

def test_allowed():
    pytest.skip("needs a CUDA GPU: none here")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    assert False

def test_runs():
    pass
'''


@pytest.fixture
def inner(pytester, monkeypatch):
    """A pytester folder with the project's conftest (its hooks) and the skipping tests."""
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport, pytest_make_collect_report")
    pytester.makepyfile(test_skipping=SKIPPING)
    return pytester


def test_off_ci_every_skip_stays_a_skip_with_its_reason(inner, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = inner.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)
    result.stdout.fnmatch_lines(["*no docker engine here*"])


def test_in_ci_a_skip_not_allowed_fails_in_every_phase_and_an_allowed_one_stays(inner, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = inner.runpytest("-rs", "-p", "no:cacheprovider")
    # The body's skip and importorskip fail in the call; the mark's and the fixture's in setup (errors).
    result.assert_outcomes(passed=1, failed=2, errors=2, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["*skipped in CI (CI=true)*no docker engine here*"])
    assert result.ret == 1


def test_a_module_skipped_at_collection_fails_in_ci(pytester, monkeypatch):
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport, pytest_make_collect_report")
    pytester.makepyfile(test_module_skip='import pytest\npytest.importorskip("a_module_nobody_has")\n'
                                         'def test_never():\n    pass\n')
    monkeypatch.setenv("CI", "true")
    failed = pytester.runpytest("-p", "no:cacheprovider")
    failed.assert_outcomes(errors=1)
    failed.stdout.fnmatch_lines(["*skipped in CI (CI=true)*a_module_nobody_has*"])
    monkeypatch.delenv("CI")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=1)


@pytest.mark.parametrize("value, ci", [("true", True), ("1", True), ("TRUE", True), ("", False), ("false", False)])
def test_ci_is_read_from_the_environment(value, ci):
    assert allowed_skips.in_ci({"CI": value}) is ci
