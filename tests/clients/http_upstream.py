#!/usr/bin/env python3
"""An HTTP/1.1 upstream for Envoy to route to, on 127.0.0.1 port 0.

  GET /stream[?seconds=N]  200, chunked: one chunk a second for N seconds (default --seconds)
  GET /...                 200 "upstream\\n" with a Content-Length

Prints {"event":"listening","port":N} first, then for each /stream request
{"event":"serving","count":N}, and {"event":"served","count":N} when every chunk went out or
{"event":"aborted","count":N,"error":"..."} when the downstream went away first. Exits after --duration seconds.
"""

import argparse
import http.server
import threading
import time
import urllib.parse

from events import emit


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30, help="default length of a /stream answer")
    parser.add_argument("--duration", type=float, default=600, help="exit after this many seconds")
    args = parser.parse_args()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path.startswith("/stream"):
                query = urllib.parse.parse_qs(url.query)
                seconds = float(query.get("seconds", [args.seconds])[0])
                self.stream(seconds)
            else:
                body = b"upstream\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def stream(self, seconds):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            emit("serving", count=int(seconds))
            sent = 0
            deadline = time.monotonic() + seconds
            try:
                while True:
                    chunk = b"chunk %d\n" % sent
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    sent += 1
                    if time.monotonic() + 1 > deadline:
                        break
                    time.sleep(1)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                emit("served", count=sent)
            except OSError as e:
                emit("aborted", count=sent, error=str(e))
                self.close_connection = True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    emit("listening", port=server.server_address[1])
    threading.Timer(args.duration, server.shutdown).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
