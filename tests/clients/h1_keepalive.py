#!/usr/bin/env python3
"""One HTTP/1.1 keep-alive connection to HOST:PORT.

Modes:
  requests (default)  GET --path every --interval-ms on the one connection
  --idle              one GET, then only wait: reports whether (and when) the server closes it

Events (one JSON object a line, `t` Unix seconds):
  {"event":"connected","conn":1}
  {"event":"response","conn":1,"status":200,"connection":"close"|"keep-alive"|null,"bytes":N}
  {"event":"closed","conn":1,"how":"eof"|"reset"|"client","pending":bool}
      the connection ended: the server closed it (eof), reset it, or the client closed it
      after a `Connection: close` answer (client); pending: a request was in flight
  {"event":"failure","reason":"..."}   a request without a complete answer
  {"event":"done","responses":N,"failures":N,"connections":N}
With --reconnect, a new connection follows a closed one (conn counts up); without it the
client stops after its connection ends. Exits after --duration seconds at most.
"""

import argparse
import socket
import time

from events import emit


class Closed(Exception):
    def __init__(self, how):
        super().__init__(how)
        self.how = how


class Conn:
    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def fill(self, deadline):
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError("no answer in time")
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            raise Closed("reset")
        except socket.timeout:
            raise TimeoutError("no answer in time")
        if not data:
            raise Closed("eof")
        self.buf += data

    def line(self, deadline):
        while b"\r\n" not in self.buf:
            self.fill(deadline)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exactly(self, n, deadline):
        while len(self.buf) < n:
            self.fill(deadline)
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def response(self, deadline):
        status_line = self.line(deadline)
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = self.line(deadline)
            if not line:
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        size = 0
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                chunk = int(self.line(deadline).split(b";")[0], 16)
                size += len(self.exactly(chunk, deadline))
                self.exactly(2, deadline)
                if chunk == 0:
                    break
        else:
            size = len(self.exactly(int(headers.get("content-length", "0")), deadline))
        return status, headers, size


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--path", default="/")
    parser.add_argument("--interval-ms", type=float, default=200, help="between requests")
    parser.add_argument("--idle", action="store_true", help="one request, then only wait")
    parser.add_argument("--reconnect", action="store_true", help="a new connection after one ends")
    parser.add_argument("--duration", type=float, default=30, help="exit after this many seconds")
    parser.add_argument("--timeout", type=float, default=10, help="bound on one request")
    args = parser.parse_args()

    end = time.monotonic() + args.duration
    responses = failures = connections = 0
    while time.monotonic() < end:
        try:
            sock = socket.create_connection((args.host, args.port), timeout=args.timeout)
        except OSError as e:
            failures += 1
            emit("failure", reason="connect: %s" % e)
            if not args.reconnect:
                break
            time.sleep(0.05)
            continue
        connections += 1
        conn = Conn(sock)
        emit("connected", conn=connections)
        how, pending = None, False
        try:
            while time.monotonic() < end:
                request = "GET %s HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (args.path, args.host, args.port)
                pending = True
                try:
                    sock.sendall(request.encode())
                except OSError:
                    raise Closed("reset")
                status, headers, size = conn.response(min(end, time.monotonic() + args.timeout))
                pending = False
                responses += 1
                emit("response", conn=connections, status=status, connection=headers.get("connection"), bytes=size)
                if headers.get("connection", "").lower() == "close":
                    how = "client"
                    break
                if args.idle:
                    # Only wait: the next read ends with the server's close, or at the end.
                    while True:
                        conn.fill(end)
                deadline = time.monotonic() + args.interval_ms / 1000
                while time.monotonic() < min(deadline, end):
                    # Between requests, a close by the server is seen as it happens.
                    try:
                        conn.fill(min(deadline, end))
                    except TimeoutError:
                        break
        except Closed as e:
            how = e.how
        except TimeoutError as e:
            if pending:
                failures += 1
                emit("failure", conn=connections, reason=str(e))
        except (OSError, ValueError, IndexError) as e:
            failures += 1
            emit("failure", conn=connections, reason="%s: %s" % (type(e).__name__, e))
            how = "reset"
        if how is not None:
            if pending:
                failures += 1
                emit("failure", conn=connections, reason="connection %s before an answer" % how)
            emit("closed", conn=connections, how=how, pending=pending)
        sock.close()
        if not args.reconnect:
            break
        # As a client keeping its pace: the next request (on a new connection) after the
        # interval. Reconnecting at once makes tens of thousands of connections a second to
        # one port, whose 4-tuples then collide with the server's TIME_WAIT ones (a reset).
        time.sleep(args.interval_ms / 1000)
    emit("done", responses=responses, failures=failures, connections=connections)


if __name__ == "__main__":
    main()
