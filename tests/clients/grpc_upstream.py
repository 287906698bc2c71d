#!/usr/bin/env python3
"""A gRPC upstream for Envoy to route to (HTTP/2), on 127.0.0.1 port 0, from grpcio:

  /grpc.test.Streamer/Count  server streaming: request google.protobuf.UInt32Value N, answers
                             N google.protobuf.StringValue messages, one a second
  grpc.health.v1.Health      the standard health service, SERVING

The service's package starts with `grpc` so that Envoy's `/grpc` route prefix takes it, as it
takes the health service. Prints {"event":"listening","port":N} first, then
{"event":"serving","count":N} for each call, and {"event":"served","count":N} or
{"event":"aborted","count":N,"error":"cancelled"} at its end. Exits after --duration seconds.
"""

import argparse
import time
from concurrent import futures

import grpc
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from events import emit

SERVICE = "grpc.test.Streamer"


def count(request, context):
    emit("serving", count=request.value)
    for n in range(request.value):
        if not context.is_active():
            emit("aborted", count=n, error="cancelled")
            return
        yield wrappers_pb2.StringValue(value="message %d" % n)
        if n + 1 < request.value:
            time.sleep(1)
    emit("served", count=request.value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="exit after this many seconds")
    args = parser.parse_args()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Count": grpc.unary_stream_rpc_method_handler(
                count,
                request_deserializer=wrappers_pb2.UInt32Value.FromString,
                response_serializer=wrappers_pb2.StringValue.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    checker.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    emit("listening", port=port)
    server.wait_for_termination(timeout=args.duration)
    server.stop(grace=None)


if __name__ == "__main__":
    main()
