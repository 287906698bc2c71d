#!/usr/bin/env python3
"""Exit-on-zero's wait: what waiting for zero connections costs the agent, and how soon it sees
zero, with N idle keep-alive connections held open through the drain and M other sockets on
the node (issue 48).

For each N in --connections and each mode in --modes, it starts `envoy-agent run` (sidecar, or
--hot-restart as a node proxy) with `--exit-on-zero connections` and `--drain-notice off` (the
idle clients are held through the drain, not told to go), opens N keep-alive connections
to Envoy's listener (one request each, answered), opens M other TCP sockets on loopback in a
process of their own (M/2 connected pairs: "the rest of the node"), sends SIGTERM, and measures
over --wait-s seconds of the drain the agent's CPU time (utime + stime from /proc, as a share of
one core). Then it closes every connection at once and measures how long until the agent logs
its `stopping` event with exit path `zero_connections` (its at_unix_ms): from the clients' last
close, and from Envoy's last close of its ends (as `ss` sees them: established or CLOSE-WAIT;
Envoy takes a while to close thousands). ZERO_WAIT_LOG_LEVEL sets the agent's log level and
ZERO_WAIT_KEEP_LOG copies each run's log there. Each cell is
--repeats runs; the table shows the median and the range.

Run through scripts/bench.sh --zero-wait (release build). Python 3 standard library only. Every
wait is bounded; every process started is stopped at the end. Needs an open-file limit of about
N + M + 1,000 (raised to the hard limit here; these machines allow 20,000 a process).

Example:
  scripts/bench.sh --zero-wait --connections 1000,15000 --other-sockets 15000
"""

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")

BOOTSTRAP = """admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}
static_resources:
  listeners:
  - name: ingress
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    traffic_direction: INBOUND
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "ok" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""

OTHERS = r"""
import socket, sys, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
n = int(sys.argv[1]) // 2
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(4096)
keep = []
while len(keep) < 2 * n:
    batch = []
    for _ in range(min(1000, n - len(keep) // 2)):
        c = socket.socket(); c.connect(l.getsockname()); batch.append(c)
    for c in batch:
        keep.append(c); keep.append(l.accept()[0])
print("ready", flush=True)
sys.stdin.read()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_for(what, within, check):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {within}s")


def events(log_path, name):
    out = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if f'"{name}"' in line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def tail(log_path):
    with open(log_path, errors="replace") as f:
        return "".join(f.readlines()[-15:])


def open_clients(port, n):
    clients = []
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    for start in range(0, n, 500):
        batch = []
        for _ in range(min(500, n - start)):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.sendall(request)
            batch.append(c)
        for c in batch:
            got = b""
            while b"\r\n\r\nok" not in got:
                chunk = c.recv(4096)
                if not chunk:
                    raise RuntimeError("a client's connection closed before its answer")
                got += chunk
        clients.extend(batch)
    return clients


def one_run(args, mode, n, workdir, run):
    port, admin = free_port(), free_port()
    boot = os.path.join(workdir, f"boot-{run}.yaml")
    with open(boot, "w") as f:
        f.write(BOOTSTRAP.format(port=port, admin=admin))
    log = os.path.join(workdir, f"agent-{run}.log")
    cmd = [args.agent, "--grpc-address", f"unix:{workdir}/grpc-{run}.sock", "run", "-c", boot,
           "--envoy-path", args.envoy, "--status-address", "127.0.0.1:0",
           "--exit-on-zero", "connections", "--minimum-drain-duration", "0s",
           # The idle clients are held through the drain, not told to go.
           "--drain-notice", "off",
           # N idle clients and no upstream: the container's default bound on downstream
           # connections (half the open-file limit, for a downstream and its upstream each)
           # would turn most of 15,000 away.
           "--max-downstream-connections", "off",
           "--termination-drain-duration", f"{int(args.wait_s) + 60}s"]
    if mode == "node":
        cmd += ["--hot-restart", "--base-id", str(40000 + os.getpid() % 1000 + run),
                "--state-dir", os.path.join(workdir, f"state-{run}"),
                "--drain-time", f"{int(args.wait_s) + 60}s",
                "--parent-shutdown-time", f"{int(args.wait_s) + 70}s"]
    cmd += ["--", "--concurrency", "1"]
    env = dict(os.environ, ENVOY_AGENT_LOG_FORMAT="json",
               ENVOY_AGENT_LOG_LEVEL=os.environ.get("ZERO_WAIT_LOG_LEVEL", "info"))
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, start_new_session=True)
    clients = []
    try:
        def live():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False
        wait_for("envoy listening", 30, live)
        time.sleep(1.0)
        clients = open_clients(port, n)
        agent.send_signal(signal.SIGTERM)
        # The drain reaches Envoy and the counting starts; then the wait is measured.
        time.sleep(1.0)
        t0, c0 = time.monotonic(), cpu_ticks(agent.pid)
        time.sleep(args.wait_s)
        t1, c1 = time.monotonic(), cpu_ticks(agent.pid)
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited during the wait: {tail(log)}")
        cpu = (c1 - c0) / CLK_TCK / (t1 - t0)
        for c in clients:
            c.close()
        clients = []
        # From the last close: closing thousands takes a while here too.
        closed_ms = time.time() * 1000
        # ... and Envoy takes a while to close its ends: when its last one went, as `ss` sees
        # it (held connections only: established, or closed by the client and not yet by Envoy).
        envoy_zero_ms = None
        while envoy_zero_ms is None and time.time() * 1000 - closed_ms < 30000:
            held = subprocess.run(
                ["ss", "-Htn", "state", "established", "state", "close-wait",
                 "sport", "=", f":{port}"], capture_output=True, text=True).stdout
            if not held.strip():
                envoy_zero_ms = time.time() * 1000
            elif events(log, "stopping"):
                break
        stopping = wait_for("the stopping event", 60, lambda: events(log, "stopping"))
        agent.wait(timeout=60)
        path = stopping[0].get("exit_path")
        if path != "zero_connections":
            raise RuntimeError(f"stopped by {path}, not zero_connections: {tail(log)}")
        seen_ms = stopping[0]["at_unix_ms"] - closed_ms
        after_envoy_ms = None if envoy_zero_ms is None else stopping[0]["at_unix_ms"] - envoy_zero_ms
        if os.environ.get("ZERO_WAIT_KEEP_LOG"):
            shutil.copy(log, os.environ["ZERO_WAIT_KEEP_LOG"])
        return cpu, seen_ms, after_envoy_ms
    finally:
        for c in clients:
            c.close()
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", required=True)
    p.add_argument("--envoy", required=True)
    p.add_argument("--connections", default="1000,15000",
                   help="comma-separated N: idle keep-alive connections held through the drain")
    p.add_argument("--other-sockets", type=int, default=15000,
                   help="other TCP sockets on the node (loopback pairs in another process)")
    p.add_argument("--modes", default="sidecar,node")
    p.add_argument("--wait-s", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    others = subprocess.Popen([sys.executable, "-c", OTHERS, str(args.other_sockets)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results = []
    try:
        if others.stdout.readline().strip() != "ready":
            raise RuntimeError("the other sockets could not be opened")
        with tempfile.TemporaryDirectory(prefix="zero-wait-") as workdir:
            run = 0
            for n in [int(x) for x in args.connections.split(",")]:
                for mode in args.modes.split(","):
                    cpus, seens, afters = [], [], []
                    for _ in range(args.repeats):
                        run += 1
                        cpu, seen, after = one_run(args, mode, n, workdir, run)
                        cpus.append(cpu)
                        seens.append(seen)
                        if after is not None:
                            afters.append(after)
                    results.append({"connections": n, "mode": mode, "other_sockets": args.other_sockets,
                                    "cpu_share": cpus, "zero_seen_ms": seens,
                                    "zero_seen_after_envoy_ms": afters})
                    after = (f"median {statistics.median(afters):4.0f} ms ({min(afters):.0f}-{max(afters):.0f})"
                             if afters else "n/a")
                    print(f"{mode:8} N={n:6}  agent CPU in the wait: median {100 * statistics.median(cpus):5.2f}% "
                          f"({100 * min(cpus):.2f}-{100 * max(cpus):.2f})  stop after the clients' last close: "
                          f"median {statistics.median(seens):4.0f} ms ({min(seens):.0f}-{max(seens):.0f}); "
                          f"after envoy's: {after}", flush=True)
    finally:
        others.stdin.close()
        others.wait(timeout=10)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"agent": args.agent, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
