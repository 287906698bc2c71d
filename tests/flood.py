#!/usr/bin/env python3
"""A neighbour holding connections open to a server: plain idle ones, and ones that send half
a request's headers and stop. Run as another user; it raises its own open-file limit.

    flood.py HOST PORT COUNT SECONDS

Prints one JSON object: how many it opened, and how many the server had closed by the end.
"""

import json
import resource
import socket
import sys
import time


def main():
    host, port, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held = []
    failed = 0
    for i in range(count):
        try:
            s = socket.create_connection((host, port), timeout=2)
        except OSError:
            failed += 1
            continue
        if i % 2:
            s.sendall(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    time.sleep(seconds)
    closed = 0
    for s in held:
        s.setblocking(False)
        # Whatever the server sent first (an HTTP/2 server's SETTINGS, a 408) is read past:
        # closed means the end of the stream.
        try:
            while True:
                if s.recv(65536) == b"":
                    closed += 1
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    print(json.dumps({"opened": len(held), "failed": failed, "closed_by_server": closed}))


if __name__ == "__main__":
    main()
