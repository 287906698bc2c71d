#!/usr/bin/env python3
"""An HTTP/3 client (aioquic) to an Envoy QUIC listener at HOST:PORT (UDP). The server's
certificate is not verified (the kit's listener has a self-signed one).

Modes:
  idle      one GET --path, then hold the connection open: reports H3 GOAWAY frames and the
            connection's end (CONNECTION_CLOSE with its error code)
  requests  a GET every --interval-ms; after a GOAWAY, a close or a request that timed out
            (--timeout) the next request goes on a new connection; counts failures

aioquic's H3Connection reads a GOAWAY and drops it, so this client also reads the server's
control stream itself (the unidirectional stream of type 0x00) and reports each GOAWAY frame.

Events (one JSON object a line, `t` Unix seconds; `conn` counts connections from 1):
  {"event":"connected","conn":1,"alpn":"h3"}
  {"event":"response","conn":1,"stream_id":0,"status":200}
  {"event":"data","conn":1,"stream_id":0,"bytes":N}
  {"event":"stream_end","conn":1,"stream_id":0}
  {"event":"reset","conn":1,"stream_id":0,"error_code":N}
  {"event":"goaway","conn":1,"last_stream_id":N}      (HTTP/3's GOAWAY carries a stream id)
  {"event":"closed","conn":1,"how":"peer"|"idle_timeout"|"client","error_code":N,
   "frame_type":N|null,"reason":"...","no_error":bool,"open_streams":N}
      no_error: the code is QUIC's NO_ERROR (0) or HTTP/3's H3_NO_ERROR (0x100)
  {"event":"failure","conn":1,"reason":"..."}
  {"event":"done","responses":N,"failures":N,"connections":N,"goaways":N}
Exits after --duration seconds at most.
"""

import argparse
import asyncio
import ssl
import time

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer, BufferReadError
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, StreamDataReceived, StreamReset

from events import emit

H3_NO_ERROR = 0x100
GOAWAY = 0x7
CONTROL_STREAM = 0x0


class ControlStreamReader:
    """Reads the server's control stream beside aioquic, for its GOAWAY frames."""

    def __init__(self, on_goaway):
        self.on_goaway = on_goaway
        self.buffers = {}  # server unidirectional stream id -> bytes not parsed yet
        self.kinds = {}  # stream id -> stream type

    def feed(self, stream_id, data):
        if stream_id % 4 != 3:  # server-initiated unidirectional streams only
            return
        buf = self.buffers.get(stream_id, b"") + data
        while True:
            reader = Buffer(data=buf)
            try:
                if stream_id not in self.kinds:
                    self.kinds[stream_id] = reader.pull_uint_var()
                    buf = buf[reader.tell():]
                    continue
                if self.kinds[stream_id] != CONTROL_STREAM:
                    buf = b""
                    break
                frame_type = reader.pull_uint_var()
                length = reader.pull_uint_var()
                payload = reader.pull_bytes(length)
            except BufferReadError:
                break
            buf = buf[reader.tell():]
            if frame_type == GOAWAY:
                self.on_goaway(Buffer(data=payload).pull_uint_var())
        self.buffers[stream_id] = buf


class Client(QuicConnectionProtocol):
    def __init__(self, *args, n=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.n = n
        self.streams = {}  # stream id -> future of the outcome
        self.statuses = {}
        self.goaway = None
        self.closed = asyncio.get_running_loop().create_future()
        self.control = ControlStreamReader(self.on_goaway)

    def on_goaway(self, stream_id):
        self.goaway = stream_id
        emit("goaway", conn=self.n, last_stream_id=stream_id)

    def request(self, authority, path):
        stream_id = self._quic.get_next_available_stream_id()
        self.h3.send_headers(
            stream_id,
            [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", authority.encode()), (b":path", path.encode())],
            end_stream=True,
        )
        self.transmit()
        future = asyncio.get_running_loop().create_future()
        self.streams[stream_id] = future
        return future

    def finish(self, stream_id, outcome):
        future = self.streams.pop(stream_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)

    def quic_event_received(self, event):
        if isinstance(event, HandshakeCompleted):
            emit("connected", conn=self.n, alpn=event.alpn_protocol)
        if isinstance(event, StreamDataReceived):
            self.control.feed(event.stream_id, event.data)
        if isinstance(event, StreamReset):
            emit("reset", conn=self.n, stream_id=event.stream_id, error_code=event.error_code)
            self.finish(event.stream_id, ("reset", event.error_code))
        if isinstance(event, ConnectionTerminated):
            if event.reason_phrase == "Idle timeout":
                how = "idle_timeout"
            elif getattr(self, "client_closing", False):
                how = "client"
            else:
                how = "peer"
            emit(
                "closed",
                conn=self.n,
                how=how,
                error_code=event.error_code,
                frame_type=event.frame_type,
                reason=event.reason_phrase,
                no_error=event.error_code in (0, H3_NO_ERROR),
                open_streams=len(self.streams),
            )
            for stream_id in list(self.streams):
                self.finish(stream_id, ("lost", how))
            if not self.closed.done():
                self.closed.set_result(how)
            return
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                status = int(dict(h3_event.headers).get(b":status", b"0"))
                self.statuses[h3_event.stream_id] = status
                emit("response", conn=self.n, stream_id=h3_event.stream_id, status=status)
            elif isinstance(h3_event, DataReceived) and h3_event.data:
                emit("data", conn=self.n, stream_id=h3_event.stream_id, bytes=len(h3_event.data))
            if getattr(h3_event, "stream_ended", False):
                emit("stream_end", conn=self.n, stream_id=h3_event.stream_id)
                self.finish(h3_event.stream_id, ("ok", self.statuses.get(h3_event.stream_id)))


def configuration(args):
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, idle_timeout=args.duration + 60)
    config.verify_mode = ssl.CERT_NONE
    config.server_name = "localhost"
    return config


class Session:
    """One connection: aioquic's `connect` context, entered and left by hand."""

    def __init__(self, args, n):
        self.args, self.n = args, n

    async def open(self):
        def protocol(*args, **kwargs):
            return Client(*args, n=self.n, **kwargs)

        self.context = connect(self.args.host, self.args.port, configuration=configuration(self.args), create_protocol=protocol)
        self.client = await asyncio.wait_for(self.context.__aenter__(), self.args.timeout)
        return self.client

    async def close(self):
        self.client.client_closing = True
        try:
            await asyncio.wait_for(self.context.__aexit__(None, None, None), 5)
        except Exception:
            pass


async def idle(args, end):
    session = Session(args, 1)
    client = await session.open()
    client.request("%s:%d" % (args.host, args.port), args.path)
    try:
        await asyncio.wait_for(asyncio.shield(client.closed), timeout=max(0, end - time.monotonic()))
    except asyncio.TimeoutError:
        pass
    await session.close()
    emit("done", responses=len(client.statuses), failures=0, connections=1, goaways=int(client.goaway is not None))


async def requests(args, end):
    responses = failures = goaways = connections = 0
    session = client = None
    authority = "%s:%d" % (args.host, args.port)
    while time.monotonic() < end:
        if client is None or client.goaway is not None or client.closed.done():
            if session is not None:
                goaways += int(client.goaway is not None)
                await session.close()
            connections += 1
            session = Session(args, connections)
            try:
                client = await session.open()
            except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                failures += 1
                emit("failure", conn=connections, reason="connect: %s %s" % (type(e).__name__, e))
                session = client = None
                await asyncio.sleep(0.05)
                continue
        try:
            outcome = await asyncio.wait_for(client.request(authority, args.path), args.timeout)
        except asyncio.TimeoutError:
            outcome = ("timeout", None)
        except Exception as e:
            outcome = ("lost", "%s: %s" % (type(e).__name__, e))
        if outcome == ("ok", 200):
            responses += 1
        else:
            failures += 1
            emit("failure", conn=client.n, reason="%s %s" % outcome)
            if outcome[0] == "timeout":
                # Nothing came back for the whole timeout: over UDP no reset says that the
                # server is gone (a killed Envoy), so the connection is given up, as a
                # browser gives up one that does not answer.
                await session.close()
                session = client = None
        await asyncio.sleep(args.interval_ms / 1000)
    if session is not None:
        goaways += int(client.goaway is not None)
        await session.close()
    emit("done", responses=responses, failures=failures, connections=connections, goaways=goaways)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["idle", "requests"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--path", default="/")
    parser.add_argument("--interval-ms", type=float, default=200, help="between requests (requests)")
    parser.add_argument("--duration", type=float, default=30, help="exit after this many seconds")
    parser.add_argument("--timeout", type=float, default=10, help="bound on the handshake and on one request")
    args = parser.parse_args()
    end = time.monotonic() + args.duration
    asyncio.run(requests(args, end) if args.mode == "requests" else idle(args, end))


if __name__ == "__main__":
    main()
