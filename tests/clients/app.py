#!/usr/bin/env python3
"""The app beside a sidecar: it calls out through Envoy's outbound listener at HOST:PORT, a GET
every --interval-ms over one HTTP/1.1 keep-alive connection (a new one only when Envoy closes
it or answers `Connection: close`), as an app's HTTP client pool does. On SIGTERM it goes on
calling for --shutdown seconds (an app finishing its work), then exits.

Events (one JSON object a line, `t` Unix seconds):
  {"event":"connected","conn":N}
  {"event":"response","conn":N,"status":200,"connection":"close"|"keep-alive"|null}
  {"event":"failure","conn":N,"reason":"..."}   a call without a 200 answer
  {"event":"stopping"}                          SIGTERM came: --shutdown seconds left
  {"event":"done","responses":N,"failures":N,"connections":N}
"""

import argparse
import signal
import socket
import time

from events import emit
from h1_keepalive import Closed, Conn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--interval-ms", type=float, default=100)
    parser.add_argument("--shutdown", type=float, default=6, help="seconds of calls after SIGTERM")
    parser.add_argument("--timeout", type=float, default=5, help="bound on one call")
    parser.add_argument("--duration", type=float, default=120, help="exit after this many seconds")
    args = parser.parse_args()

    end = [time.monotonic() + args.duration]

    def on_term(_signum, _frame):
        end[0] = min(end[0], time.monotonic() + args.shutdown)
        emit("stopping")

    signal.signal(signal.SIGTERM, on_term)
    responses = failures = connections = 0
    conn = None
    while time.monotonic() < end[0]:
        if conn is None:
            try:
                sock = socket.create_connection((args.host, args.port), timeout=args.timeout)
            except OSError as e:
                failures += 1
                emit("failure", conn=connections, reason="connect: %s" % e)
                time.sleep(args.interval_ms / 1000)
                continue
            connections += 1
            conn = Conn(sock)
            emit("connected", conn=connections)
        try:
            request = "GET / HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (args.host, args.port)
            conn.sock.sendall(request.encode())
            status, headers, _ = conn.response(time.monotonic() + args.timeout)
            responses += 1
            emit("response", conn=connections, status=status, connection=headers.get("connection"))
            if status != 200:
                failures += 1
                emit("failure", conn=connections, reason="status %d" % status)
            if headers.get("connection", "").lower() == "close":
                conn.sock.close()
                conn = None
        except (Closed, OSError, TimeoutError, ValueError, IndexError) as e:
            failures += 1
            emit("failure", conn=connections, reason="%s: %s" % (type(e).__name__, e))
            conn.sock.close()
            conn = None
        time.sleep(args.interval_ms / 1000)
    emit("done", responses=responses, failures=failures, connections=connections)


if __name__ == "__main__":
    main()
