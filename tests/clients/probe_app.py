#!/usr/bin/env python3
"""An app for the agent's app probes (/app-health/...) to probe, on 127.0.0.1 port 0.

  http [--cert C --key K]  HTTP/1.1 (HTTPS with a certificate):
                             GET /healthz  200 "ok"
                             GET /sick     503 "sick"
                             GET /hang     never answers (the connection stays open)
  grpc                     grpc.health.v1.Health from grpcio-health-checking:
                             service ""      SERVING
                             service "down"  NOT_SERVING
                             service "hang"  Check never answers
                             anything else   NOT_FOUND (grpcio's)

Prints {"event":"listening","port":N} first, then {"event":"serving","count":0} each time a
request is taken that will never be answered (/hang, service "hang"). Exits after --duration
seconds.
"""

import argparse
import http.server
import ssl
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from events import emit


def serve_http(args, stop):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def do_GET(self):
            if self.path == "/hang":
                emit("serving", count=0)
                stop.wait(args.duration)
                return
            status, body = (200, b"ok\n") if self.path == "/healthz" else (503, b"sick\n")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if args.cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.cert, args.key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    emit("listening", port=server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop.wait(args.duration)


class Checker(health.HealthServicer):
    def __init__(self, stop, duration):
        super().__init__()
        self._stop = stop
        self._duration = duration

    def Check(self, request, context):
        if request.service == "hang":
            emit("serving", count=0)
            self._stop.wait(self._duration)
        return super().Check(request, context)


def serve_grpc(args, stop):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    checker = Checker(stop, args.duration)
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    checker.set("down", health_pb2.HealthCheckResponse.NOT_SERVING)
    checker.set("hang", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    emit("listening", port=port)
    stop.wait(args.duration)
    server.stop(grace=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["http", "grpc"])
    parser.add_argument("--cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--key", help="the certificate's key (PEM)")
    parser.add_argument("--duration", type=float, default=600, help="exit after this many seconds")
    args = parser.parse_args()
    stop = threading.Event()
    if args.kind == "http":
        serve_http(args, stop)
    else:
        serve_grpc(args, stop)


if __name__ == "__main__":
    main()
