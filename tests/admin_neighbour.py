#!/usr/bin/env python3
"""An unprivileged process on the node (or in the pod), after Envoy's admin API.

Run as another user (uid 65534) in the agent's network namespace. Envoy's admin API has no
authentication: whoever connects can stop Envoy (POST /quitquitquit), drain its listeners
(/drain_listeners) or fail its health checks (/healthcheck/fail). It tries each of them on every
target it is given (the TCP ports and Unix sockets an Envoy listens on, found by the test as
root) and prints one JSON list: for each target and request, what happened ("http <status>" when
a request got an answer, "error <errno name>" when the connection was refused).

    admin_neighbour.py TARGET...      (TARGET: tcp:127.0.0.1:15000 or unix:/path)
"""

import errno
import json
import os
import socket
import sys

REQUESTS = ["/quitquitquit", "/drain_listeners", "/healthcheck/fail"]


def connect(target):
    kind, _, where = target.partition(":")
    if kind == "tcp":
        host, _, port = where.rpartition(":")
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.settimeout(10)
        s.connect((host.strip("[]"), int(port)))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(where)
    return s


def post(target, path):
    try:
        s = connect(target)
    except OSError as e:
        return "error " + errno.errorcode.get(e.errno, str(e.errno))
    with s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except OSError:
            pass
    line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = line.split()
    return "http " + parts[1] if len(parts) > 1 else "answered " + repr(line)


def main():
    results = []
    for target in sys.argv[1:]:
        for path in REQUESTS:
            results.append({"target": target, "request": path, "outcome": post(target, path)})
    results.append({"uid": os.getuid()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
