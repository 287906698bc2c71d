"""Shared by the clients and upstreams in this folder: one JSON object per line on stdout for
each fact, with `t` the Unix time in seconds (a float), flushed at once so that the test kit
(tests/src/clients.rs) sees it as it happens."""

import json
import sys
import time


def emit(event, **fields):
    fields = {"event": event, **fields, "t": time.time()}
    sys.stdout.write(json.dumps(fields, separators=(",", ":")) + "\n")
    sys.stdout.flush()
