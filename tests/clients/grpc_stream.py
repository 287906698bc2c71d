#!/usr/bin/env python3
"""A gRPC client (grpcio) of a server-streaming RPC through Envoy at HOST:PORT (cleartext
HTTP/2): /grpc.test.Streamer/Count, asking for --messages messages (one a second, from
tests/clients/grpc_upstream.py).

grpcio does not surface HTTP/2 GOAWAY frames: the client reports each message and the call's
final status; a stream cut by the proxy ends with a status other than OK (UNAVAILABLE,
INTERNAL), a stream let finish ends OK with every message.

Events (one JSON object a line, `t` Unix seconds):
  {"event":"message","n":0,"value":"message 0"}
  {"event":"status","code":"OK"|"UNAVAILABLE"|...,"details":"...","clean":bool,"messages":N}
      clean: OK with all the messages asked for
  {"event":"done","messages":N,"code":"OK"}
Exits after --duration seconds at most (the call's deadline; the status is then
DEADLINE_EXCEEDED).
"""

import argparse

import grpc
from google.protobuf import wrappers_pb2

from events import emit


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--messages", type=int, default=30, help="how many messages to ask for")
    parser.add_argument("--duration", type=float, default=60, help="the call's deadline, seconds")
    args = parser.parse_args()
    target = "%s:%d" % (args.host, args.port)
    received = 0
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(
            "/grpc.test.Streamer/Count",
            request_serializer=wrappers_pb2.UInt32Value.SerializeToString,
            response_deserializer=wrappers_pb2.StringValue.FromString,
        )(wrappers_pb2.UInt32Value(value=args.messages), timeout=args.duration)
        try:
            for message in call:
                emit("message", n=received, value=message.value)
                received += 1
            code, details = call.code(), call.details()
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        emit("status", code=code.name, details=details or "", clean=code == grpc.StatusCode.OK and received == args.messages, messages=received)
    emit("done", messages=received, code=code.name)


if __name__ == "__main__":
    main()
