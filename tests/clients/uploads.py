#!/usr/bin/env python3
"""Uploads held open: the load that fills a buffering Envoy's memory (issue 50).

Every --every-ms a new upload starts: a POST of --size bytes on its own HTTP/1.1 connection,
all of the body sent at once but its last byte, which it holds. A listener with Envoy's buffer
filter keeps every held body in memory, so Envoy's memory grows by --size each --every-ms.
Once the last upload has started, and --hold-s later, each sends its last byte and reads the
answer. An answer that comes before (Envoy turning the upload away: 503) is read as it comes.

Events (one JSON object a line, `t` Unix seconds):
  {"event":"response","conn":N,"status":200|503|...}   an upload's answer
  {"event":"failure","conn":N,"reason":"..."}          an upload cut without an answer
  {"event":"done","responses":N200,"failures":NOTHER,"connections":COUNT}
"""

import argparse
import select
import socket
import threading
import time

from events import emit

CHUNK = 256 * 1024


def early_answer(sock):
    """The status of an answer already there, if any."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return None
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("closed by envoy")
    return int(data.split(b" ", 2)[1])


def upload(n, args, release, results):
    try:
        sock = socket.create_connection((args.host, args.port), timeout=30)
    except OSError as e:
        results[n] = ("failure", "connect: %s" % e)
        return
    try:
        head = "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (args.path, args.host, args.size)
        sock.sendall(head.encode())
        body = b"x" * CHUNK
        left = args.size - 1
        while left > 0:
            status = early_answer(sock)
            if status is not None:
                results[n] = ("response", status)
                return
            piece = body[: min(CHUNK, left)]
            sock.sendall(piece)
            left -= len(piece)
        release.wait()
        status = early_answer(sock)
        if status is None:
            sock.sendall(b"x")
            sock.settimeout(30)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed by envoy")
            status = int(data.split(b" ", 2)[1])
        results[n] = ("response", status)
    except (OSError, ValueError, IndexError) as e:
        results[n] = ("failure", "%s: %s" % (type(e).__name__, e))
    finally:
        sock.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--path", default="/upload")
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--size", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--every-ms", type=float, default=250)
    parser.add_argument("--hold-s", type=float, default=1)
    args = parser.parse_args()

    release = threading.Event()
    results = {}
    threads = []
    for n in range(1, args.count + 1):
        t = threading.Thread(target=upload, args=(n, args, release, results), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(args.every_ms / 1000)
    time.sleep(args.hold_s)
    release.set()
    for t in threads:
        t.join(60)
    ok = failures = 0
    for n in sorted(results):
        kind, value = results[n]
        if kind == "response":
            emit("response", conn=n, status=value)
            ok += value == 200
            failures += value != 200
        else:
            emit("failure", conn=n, reason=value)
            failures += 1
    emit("done", responses=ok, failures=failures, connections=args.count)


if __name__ == "__main__":
    main()
