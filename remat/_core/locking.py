"""The one lock remat's traces take: make_fx and the fake tensor caches keep process-wide
state, so one trace runs at a time in the process (reentrant: a trace may build another)."""

from __future__ import annotations

import threading

TRACE_LOCK = threading.RLock()
