"""Reading a /metrics page in tests: its samples by (name, labels), one value, and how much a
counter grew between two scrapes, with prometheus-client's own parser."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 if none)."""
    wanted = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def has(samples: dict, name: str, **labels) -> bool:
    wanted = {(k, str(v)) for k, v in labels.items()}
    return any(n == name and wanted <= set(ls) for n, ls in samples)


def grew(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
