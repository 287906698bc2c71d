#!/usr/bin/env python3
"""An HTTP/2 client (Python's h2) over cleartext TCP with prior knowledge (h2c), to HOST:PORT.

Modes:
  idle      one GET --path, then hold the connection open: reports GOAWAY frames and the close
  stream    one GET of a streaming path (--path, e.g. /stream?seconds=30): reports each DATA
            chunk, GOAWAY frames, the stream's end or reset, and the close
  requests  a GET every --interval-ms; after a GOAWAY the next request goes on a new
            connection; counts failures (a reset or refused stream, a connection lost with a
            request in flight, a non-200 answer)
  streams   a long-lived stream at all times, as a gRPC client keeps one: a GET of a streaming
            path; when its connection gets a GOAWAY, the next stream opens at once on a new
            connection (the old one runs on until it ends); when a stream ends without one,
            the next opens after --interval-ms. A stream that ends other than cleanly (a reset,
            a lost connection) with no GOAWAY first on its connection was cut without being
            told: a failure

Events (one JSON object a line, `t` Unix seconds; `conn` counts connections from 1):
  {"event":"connected","conn":1}
  {"event":"response","conn":1,"stream_id":1,"status":200}
  {"event":"data","conn":1,"stream_id":1,"bytes":N}
  {"event":"stream_end","conn":1,"stream_id":1}
  {"event":"reset","conn":1,"stream_id":1,"error_code":N}
  {"event":"goaway","conn":1,"last_stream_id":N,"error_code":0}
  {"event":"closed","conn":1,"how":"eof"|"reset"|"client","open_streams":N}
  {"event":"failure","conn":1,"reason":"..."}
  {"event":"done","responses":N,"failures":N,"connections":N,"goaways":N}
Exits after --duration seconds at most.
"""

import argparse
import asyncio
import time

import h2.config
import h2.connection
import h2.events

from events import emit

# h2 takes a GOAWAY for the end of the connection: any frame after it (the DATA of a stream the
# GOAWAY let finish, a PING) raises ProtocolError. A graceful GOAWAY is not that: the streams
# up to its last_stream_id go on. So in h2's CLOSED state, receiving (and the acknowledgements
# and resets a client sends) stays allowed; only new streams (SEND_HEADERS) are refused.
_machine = h2.connection.H2ConnectionStateMachine
_open, _closed = h2.connection.ConnectionState.CLIENT_OPEN, h2.connection.ConnectionState.CLOSED
for (_state, _input), (_func, _target) in list(_machine._transitions.items()):
    if _state == _open and _target == _open and _input != h2.connection.ConnectionInputs.SEND_HEADERS:
        _machine._transitions.setdefault((_closed, _input), (_func, _closed))


class Connection:
    def __init__(self, n, reader, writer, authority):
        self.n = n
        self.reader = reader
        self.writer = writer
        self.authority = authority
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.flush()
        self.streams = {}  # stream id -> future of (status or None), done at stream end/reset
        self.statuses = {}
        self.goaway = None  # last_stream_id of the latest GOAWAY
        self.closed = asyncio.get_running_loop().create_future()

    def flush(self):
        data = self.h2.data_to_send()
        if data:
            self.writer.write(data)

    def request(self, path):
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            stream_id,
            [(":method", "GET"), (":scheme", "http"), (":authority", self.authority), (":path", path)],
            end_stream=True,
        )
        self.flush()
        future = asyncio.get_running_loop().create_future()
        self.streams[stream_id] = future
        return stream_id, future

    def finish(self, stream_id, outcome):
        future = self.streams.pop(stream_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)

    async def run(self):
        how = "eof"
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                for event in self.h2.receive_data(data):
                    self.handle(event)
                self.flush()
        except (ConnectionResetError, BrokenPipeError):
            how = "reset"
        except asyncio.CancelledError:
            how = "client"
        except Exception as e:  # a protocol error: report it as the end of the connection
            emit("failure", conn=self.n, reason="%s: %s" % (type(e).__name__, e))
            how = "reset"
        emit("closed", conn=self.n, how=how, open_streams=len(self.streams))
        for stream_id in list(self.streams):
            self.finish(stream_id, ("lost", how))
        if not self.closed.done():
            self.closed.set_result(how)

    def handle(self, event):
        if isinstance(event, h2.events.ResponseReceived):
            status = int(dict(event.headers).get(":status", "0"))
            self.statuses[event.stream_id] = status
            emit("response", conn=self.n, stream_id=event.stream_id, status=status)
        elif isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            emit("data", conn=self.n, stream_id=event.stream_id, bytes=len(event.data))
        elif isinstance(event, h2.events.StreamEnded):
            emit("stream_end", conn=self.n, stream_id=event.stream_id)
            self.finish(event.stream_id, ("ok", self.statuses.get(event.stream_id)))
        elif isinstance(event, h2.events.StreamReset):
            emit("reset", conn=self.n, stream_id=event.stream_id, error_code=int(event.error_code))
            self.finish(event.stream_id, ("reset", int(event.error_code)))
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event.last_stream_id
            emit("goaway", conn=self.n, last_stream_id=event.last_stream_id, error_code=int(event.error_code))
            # Streams above last_stream_id were not processed: they will never finish.
            for stream_id in [s for s in self.streams if s > event.last_stream_id]:
                self.finish(stream_id, ("refused", event.last_stream_id))

    def close(self):
        try:
            self.writer.close()
        except Exception:
            pass


async def connect(n, host, port):
    reader, writer = await asyncio.open_connection(host, port)
    conn = Connection(n, reader, writer, "%s:%d" % (host, port))
    emit("connected", conn=n)
    conn.task = asyncio.create_task(conn.run())
    return conn


async def single(args, end):
    """idle and stream: one connection, one request, then watch until the connection ends."""
    conn = await connect(1, args.host, args.port)
    conn.request(args.path)
    try:
        await asyncio.wait_for(asyncio.shield(conn.closed), timeout=max(0, end - time.monotonic()))
    except asyncio.TimeoutError:
        conn.task.cancel()
        await asyncio.gather(conn.task, return_exceptions=True)
    conn.close()
    emit("done", responses=len(conn.statuses), failures=0, connections=1, goaways=int(conn.goaway is not None))


async def streams(args, end):
    """streams: one long-lived stream at all times; a stream cut untold is a failure."""
    counts = {"responses": 0, "failures": 0, "connections": 0, "goaways": 0}
    background = set()

    async def judged(conn, future):
        outcome = await future
        if outcome[0] == "ok":
            counts["responses"] += 1
        elif conn.goaway is None:
            counts["failures"] += 1
            emit("failure", conn=conn.n, reason="stream cut without a goaway: %s %s" % outcome)
        conn.task.cancel()
        conn.close()

    while time.monotonic() < end:
        counts["connections"] += 1
        try:
            conn = await asyncio.wait_for(connect(counts["connections"], args.host, args.port), args.timeout)
        except (OSError, asyncio.TimeoutError) as e:
            counts["failures"] += 1
            emit("failure", conn=counts["connections"], reason="connect: %s" % e)
            await asyncio.sleep(0.05)
            continue
        _, future = conn.request(args.path)
        task = asyncio.create_task(judged(conn, future))
        background.add(task)
        task.add_done_callback(background.discard)
        # Until the stream ends or its connection is told to go, whichever is first.
        while not task.done() and conn.goaway is None and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if conn.goaway is not None:
            counts["goaways"] += 1
        elif task.done():
            await asyncio.sleep(args.interval_ms / 1000)
    for task in list(background):
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    emit("done", **counts)


async def requests(args, end):
    responses = failures = goaways = connections = 0
    conn = None
    while time.monotonic() < end:
        if conn is None or conn.goaway is not None or conn.closed.done():
            if conn is not None:
                goaways += int(conn.goaway is not None)
                conn.task.cancel()
                conn.close()
            try:
                connections += 1
                conn = await asyncio.wait_for(connect(connections, args.host, args.port), args.timeout)
            except (OSError, asyncio.TimeoutError) as e:
                failures += 1
                emit("failure", conn=connections, reason="connect: %s" % e)
                conn = None
                await asyncio.sleep(0.05)
                continue
        try:
            _, future = conn.request(args.path)
            outcome = await asyncio.wait_for(future, args.timeout)
        except asyncio.TimeoutError:
            outcome = ("timeout", None)
        except Exception as e:  # h2 refuses to open a stream on a closed connection
            outcome = ("lost", "%s: %s" % (type(e).__name__, e))
        if outcome == ("ok", 200):
            responses += 1
        else:
            failures += 1
            emit("failure", conn=conn.n, reason="%s %s" % outcome)
        await asyncio.sleep(args.interval_ms / 1000)
    if conn is not None:
        goaways += int(conn.goaway is not None)
        conn.task.cancel()
        await asyncio.gather(conn.task, return_exceptions=True)
        conn.close()
    emit("done", responses=responses, failures=failures, connections=connections, goaways=goaways)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["idle", "stream", "streams", "requests"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--path", default=None, help="default / (idle, requests), /stream?seconds=60 (stream)")
    parser.add_argument("--interval-ms", type=float, default=200, help="between requests (requests)")
    parser.add_argument("--duration", type=float, default=30, help="exit after this many seconds")
    parser.add_argument("--timeout", type=float, default=10, help="bound on one request (requests)")
    args = parser.parse_args()
    if args.path is None:
        args.path = "/stream?seconds=60" if args.mode in ("stream", "streams") else "/"
    end = time.monotonic() + args.duration
    run = {"requests": requests, "streams": streams}.get(args.mode, single)
    asyncio.run(run(args, end))


if __name__ == "__main__":
    main()
