"""Read one counter from an engine server's Prometheus ``/metrics`` text (the text exposition format).

The parsing is prometheus_client's (``text_string_to_metric_families``, a fleetrl dependency); this module
only picks the samples of one name and sums them: a counter may have several series (one per label set,
e.g. vLLM's ``engine="0"``, ``engine="1"`` with data parallelism). Anything it cannot read is None, never
an error: the caller (the fleet's stall detector) treats "cannot say" as no evidence. Example::

    counter_total(text, "vllm:generation_tokens_total")  # 1234, or None where the text has no such sample
"""

from __future__ import annotations

import logging
import math

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


def counter_total(text: str, name: str) -> int | None:
    """The sum over every sample named ``name`` (its full sample name, e.g. ``..._total``), rounded to an int;
    None when the text has no such sample, does not parse, or a value is not a finite number >= 0."""
    total, found = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != name:
                    continue
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    log.debug("metrics: %s has the value %r: no counter", name, sample.value)
                    return None
                total, found = total + value, True
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # what the parser raises on bad text
        log.debug("metrics: the /metrics text does not parse: %s", exc)
        return None
    return round(total) if found else None
