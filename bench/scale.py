#!/usr/bin/env python3
"""Scale benchmark: what envoy-agent costs Envoy on a large static config versus a small one.

For each size (LARGE: 300 HTTP listeners, 5000 clusters; SMALL: 10x fewer) it generates a static
bootstrap and measures, with Envoy at --concurrency 1:

  alone    Envoy started directly: start-to-ready time, idle CPU over --idle-s.
  sidecar  Envoy under `envoy-agent run` (no hot restart): the same, the agent's own idle CPU,
           its RSS and peak RSS (VmHWM); then a drain held by one idle keep-alive connection
           (--exit-on-zero-active-connections): Envoy's and the agent's CPU share over 8 s.
  node     The same under `envoy-agent run --hot-restart`, plus --restarts hot restarts (SIGHUP,
           config unchanged): how much later than an independent poller of Envoy's /ready the
           agent logged the new epoch LIVE (its `handoff` event), and the pre-flight time of that
           (cached) restart; then the same drain as the sidecar's.
  scrape   A sidecar again (the agent at debug level, for its `scrape_walk` events): Prometheus
           scrapes through the agent's /stats/prometheus, each --scrape-repeats times (medians):
           one of everything, one `?usedonly`, and two of everything started together. For each,
           the bytes, the share of answers with Envoy's stats in them, the wall time, Envoy's CPU
           time over the scrape (its main thread walks the stats) and the walks of Envoy's stats
           the agent logged (two concurrent scrapes of one query share one; an agent without
           shared walks logs none); then the agent's peak RSS (VmHWM). --scrapes-only runs this
           part alone.

The poller opens a new connection every 2 ms without waiting for earlier answers, and tells the
epochs apart by the admin port's listening socket (asked of the kernel), not only by a non-200:
the old epoch's admin often closes and the new one's binds within 2 ms, and requests then wait in
the new epoch's accept queue and get 200 once it is LIVE (see Poller).

Prints a table (small / large / growth = large / small) and, with --json PATH, writes a report.
Python 3 standard library only. Every wait is bounded; every process started is stopped at the
end (also on Ctrl-C or an error), and the shared memory files of the runs are removed.

Example (a short run against a debug build):
  python3 bench/scale.py --agent target/debug/envoy-agent --envoy "$ENVOY_PATH" \\
      --only small --idle-s 5 --restarts 1
"""

import argparse
import datetime
import errno
import http.client
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK_TCK = os.sysconf("SC_CLK_TCK")
SETTLE_S = 3.0
DRAIN_WINDOW_S = 8.0
POLL_INTERVAL_S = 0.002


def port_range():
    """Ports for the bootstraps: 10,000 ports from 20,000 below the kernel's ephemeral range
    (12768..22767 by default), so that no outgoing connection takes one between the runs that
    reuse them, and clear of the 10,000 just below it where the project's tests take theirs."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_lo = 32768
    lo = ephemeral_lo - 20000
    return (lo, lo + 10000) if lo >= 1024 else (12000, 22000)


PORT_RANGE = port_range()


class Interrupted(Exception):
    pass


def log(msg):
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Arguments


def size_pair(text):
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected LISTENERS,CLUSTERS (e.g. 300,5000), got {text!r}")
    listeners, clusters = int(m.group(1)), int(m.group(2))
    if listeners < 1:
        raise argparse.ArgumentTypeError("at least one listener is needed (the drain uses listener 0)")
    return listeners, clusters


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="scale.py",
        description="Measure what envoy-agent costs Envoy on a large static config versus a small one.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--agent", default=os.path.join(REPO, "target", "release", "envoy-agent"),
                   help="the envoy-agent binary (default: %(default)s)")
    p.add_argument("--envoy", default=os.environ.get("ENVOY_PATH"),
                   help="the Envoy binary (default: $ENVOY_PATH)")
    p.add_argument("--json", metavar="PATH", help="write the JSON report here")
    p.add_argument("--idle-s", type=positive_float, default=20.0,
                   help="idle CPU window in seconds (default: %(default)s)")
    p.add_argument("--restarts", type=non_negative_int, default=3,
                   help="hot restarts measured per size (default: %(default)s)")
    p.add_argument("--only", choices=["small", "large"], help="run one size only")
    p.add_argument("--large", type=size_pair, default=(300, 5000), metavar="L,C",
                   help="listeners,clusters of the large config (default: 300,5000)")
    p.add_argument("--small", type=size_pair, default=(30, 500), metavar="L,C",
                   help="listeners,clusters of the small config (default: 30,500)")
    p.add_argument("--ready-timeout-s", type=positive_float, default=180.0,
                   help="bound on every wait for Envoy to be ready or LIVE (default: %(default)s)")
    p.add_argument("--scrape-repeats", type=non_negative_int, default=3,
                   help="times each scrape measurement is repeated (default: %(default)s)")
    p.add_argument("--scrapes-only", action="store_true",
                   help="measure only the scrapes (the scrape part), not the rest")
    p.add_argument("--keep-dir", action="store_true",
                   help="keep the temporary directory (bootstraps, logs) and print its path")
    args = p.parse_args(argv)
    if not args.envoy:
        p.error("--envoy is required when $ENVOY_PATH is not set")
    for name in ("agent", "envoy"):
        path = getattr(args, name)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            p.error(f"--{name}: not an executable file: {path}")
    return args


# ---------------------------------------------------------------------------------------------
# Bootstraps


def free_ports(count, taken):
    """`count` ports of PORT_RANGE that bind now on 127.0.0.1 and are not in `taken`."""
    lo, hi = PORT_RANGE
    start = random.randrange(lo, hi)
    ports = []
    for i in range(hi - lo):
        port = lo + (start - lo + i) % (hi - lo)
        if port in taken:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            s.close()
        ports.append(port)
        taken.add(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"cannot find {count} free ports in {PORT_RANGE}")


def bootstrap_yaml(listeners, clusters, listener_ports, admin_port, dead_port):
    out = [
        "# Generated by bench/scale.py",
        "admin:",
        "  address:",
        "    socket_address: {address: 127.0.0.1, port_value: %d}" % admin_port,
        "static_resources:",
        "  listeners:",
    ]
    # Clusters are shared out over the listeners' routes (/c<j>/ -> c<j>); "/" answers directly.
    routes_of = [[] for _ in range(listeners)]
    for j in range(clusters):
        routes_of[j % listeners].append(j)
    for i in range(listeners):
        out += [
            f"  - name: l{i}",
            "    address:",
            "      socket_address: {address: 127.0.0.1, port_value: %d}" % listener_ports[i],
            "    filter_chains:",
            "    - filters:",
            "      - name: envoy.filters.network.http_connection_manager",
            "        typed_config:",
            '          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager',
            f"          stat_prefix: l{i}",
            "          http_filters:",
            "          - name: envoy.filters.http.router",
            "            typed_config:",
            '              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router',
            "          route_config:",
            f"            name: r{i}",
            "            virtual_hosts:",
            f"            - name: v{i}",
            '              domains: ["*"]',
            "              routes:",
        ]
        for j in routes_of[i]:
            out += [
                f"              - match: {{prefix: /c{j}/}}",
                f"                route: {{cluster: c{j}}}",
            ]
        out += [
            "              - match: {prefix: /}",
            "                direct_response: {status: 200, body: {inline_string: ok}}",
        ]
    out.append("  clusters:" if clusters else "  clusters: []")
    for j in range(clusters):
        out += [
            f"  - name: c{j}",
            "    type: STATIC",
            "    connect_timeout: 1s",
            "    load_assignment:",
            f"      cluster_name: c{j}",
            "      endpoints:",
            "      - lb_endpoints:",
            "        - endpoint:",
            "            address:",
            "              socket_address: {address: 127.0.0.1, port_value: %d}" % dead_port,
        ]
    return "\n".join(out) + "\n"


class Size:
    def __init__(self, name, listeners, clusters, workdir, taken_ports):
        self.name = name
        self.listeners = listeners
        self.clusters = clusters
        ports = free_ports(listeners + 2, taken_ports)
        self.listener_ports = ports[:listeners]
        self.admin_port = ports[listeners]
        dead_port = ports[listeners + 1]  # nothing listens there: clusters need not be reachable
        self.path = os.path.join(workdir, f"{name}.yaml")
        with open(self.path, "w") as f:
            f.write(bootstrap_yaml(listeners, clusters, self.listener_ports, self.admin_port, dead_port))
        self.bytes = os.path.getsize(self.path)


# ---------------------------------------------------------------------------------------------
# Processes


class Tracker:
    """Everything started, so that it is all stopped at the end."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.procs = []  # Popen objects
        self.base_ids = []  # Envoy base ids used (shared memory to remove)
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        self._next_base = 30_000_000 + (os.getpid() % 100_000) * 100

    def base_id(self):
        """An unused Envoy base id; the next one is reserved too (the agent's cold family)."""
        for _ in range(1000):
            base = self._next_base
            self._next_base += 2
            names = {f"envoy_shared_memory_{b * 10}" for b in (base, base + 1)}
            if names & self.shm_before or any(os.path.exists("/dev/shm/" + n) for n in names):
                continue
            self.base_ids += [base, base + 1]
            return base
        raise RuntimeError("no unused base id found")

    def popen(self, argv, logfile, env=None):
        f = open(logfile, "ab")
        try:
            # A new session: a Ctrl-C reaches this script only, which then stops them in order.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                    start_new_session=True,
                                    env={**os.environ, **env} if env else None)
        finally:
            f.close()
        self.procs.append(proc)
        return proc

    def ours(self):
        """Pids of live processes whose command line names our work directory (Envoys left by
        an agent that died, pre-flight checks), besides those we started."""
        found = set()
        for pid in pids():
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if (self.workdir + "/").encode() in cmd:
                found.add(pid)
        return found

    def cleanup(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for _ in range(3):
            left = self.ours()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        for base in self.base_ids:
            path = f"/dev/shm/envoy_shared_memory_{base * 10}"
            if os.path.basename(path) not in self.shm_before:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def cpu_s(pid):
    """utime + stime of `pid` in seconds (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    # fields[0] is the state (field 3): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu_s(pid):
    """cutime + cstime of `pid` (its reaped children) in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[13]) + int(fields[14])) / CLK_TCK


def status_kib(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def children(pid):
    kids = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids.update(int(x) for x in f.read().split())
            except OSError:
                pass
    except OSError:
        pass
    return kids


def envoy_children(agent_pid, envoy_path):
    """The agent's Envoy children: {pid: argv}."""
    envoy_real = os.path.realpath(envoy_path)
    found = {}
    for pid in children(agent_pid):
        argv = cmdline(pid)  # A zombie has none: left out.
        if argv and os.path.realpath(argv[0]) == envoy_real:
            found[pid] = argv
    return found


def is_check(argv):
    return "--mode" in argv or "--hot-restart-version" in argv or "--version" in argv


def helper_envoys(agent_pid, envoy_path):
    """The agent's Envoy children that are checks (`--mode validate`, `--hot-restart-version`)."""
    return [pid for pid, argv in envoy_children(agent_pid, envoy_path).items() if is_check(argv)]


def serving_envoys(agent_pid, envoy_path):
    """The agent's Envoy children that serve (not checks), as {pid: restart epoch}."""
    found = {}
    for pid, argv in envoy_children(agent_pid, envoy_path).items():
        if is_check(argv):
            continue
        epoch = 0
        if "--restart-epoch" in argv:
            try:
                epoch = int(argv[argv.index("--restart-epoch") + 1])
            except (IndexError, ValueError):
                pass
        found[pid] = epoch
    return found


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: Envoy's admin on the agent's socket (a node proxy's default)."""

    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path_ = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path_)


def http_status(admin, path="/ready", timeout=1.0):
    """The status of GET `path` on Envoy's admin: `admin` is a TCP port on 127.0.0.1 or a Unix
    socket's path."""
    if isinstance(admin, str):
        conn = UnixHTTPConnection(admin, timeout)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def wait_for(what, predicate, timeout, interval=0.05, alive=None):
    """Poll `predicate` until it returns something truthy; bounded; fails early when `alive`
    (a Popen) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"{what}: the process exited (code {alive.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def stop(proc, timeout=60.0):
    """SIGTERM, bounded wait, SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"pid {proc.pid} did not exit {timeout:.0f} s after SIGTERM: killed")
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def scrape(address_file, query=""):
    """GET /stats/prometheus[?query] from the agent's status server, read to the end."""
    try:
        with open(address_file) as f:
            host, port = f.read().strip().rsplit(":", 1)
        started = time.monotonic()
        path = "/stats/prometheus" + (f"?{query}" if query else "")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            total = 0
            # The agent's own metrics come first: whether Envoy's stats came with them.
            start = b""
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                total += len(chunk)
                if len(start) < 8192:
                    start += chunk[:8192]
        return {"scrape_mib": total / (1 << 20), "scrape_s": time.monotonic() - started,
                "stats_up": float(b"\nenvoy_agent_envoy_stats_up 1\n" in start)}
    except (OSError, ValueError) as e:
        log(f"scrape failed: {e}")
        return {"scrape_mib": None, "scrape_s": None, "stats_up": None}


def measure_cpu(pids_, window_s):
    """CPU seconds of each pid over the window (None for a pid that went away)."""
    before = {p: cpu_s(p) for p in pids_}
    time.sleep(window_s)
    after = {p: cpu_s(p) for p in pids_}
    return {p: (after[p] - before[p]) if before[p] is not None and after[p] is not None else None
            for p in pids_}


# ---------------------------------------------------------------------------------------------
# The agent's JSON log


def parse_ts(text):
    """RFC 3339 timestamp (any fraction length, Z or offset) -> seconds since the epoch."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    if not m:
        raise ValueError(f"unexpected timestamp {text!r}")
    base = datetime.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    frac = float("0." + m.group(2)) if m.group(2) else 0.0
    return base.timestamp() + frac


class AgentLog:
    def __init__(self, path):
        self.path = path
        self.offset = 0
        # Envoy's admin as the agent placed it (start_agent): a TCP port or a socket's path.
        self.admin = None
        self.events = []
        self.partial = b""

    def read(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.events
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass
        return self.events

    def walks(self):
        """The agent's walks of Envoy's stats for scrapes (debug level; one event per walk, at
        its end)."""
        return [e for e in self.read() if e.get("event") == "scrape_walk"]

    def handoffs(self, first=False):
        return [e for e in self.read() if e.get("event") == "handoff" and bool(e.get("first")) == first]

    def problems(self):
        return [e for e in self.read() if str(e.get("level", "")).upper() in ("WARN", "WARNING", "ERROR")]


# ---------------------------------------------------------------------------------------------
# The independent poller


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN = 10


def listen_inodes(admin):
    """Which listening socket serves `admin` (which process generation owns it). A TCP port: the
    inodes of the IPv4 sockets listening on it, asked of the kernel over sock_diag for listening
    sockets only (/proc/net/tcp lists every socket, tens of thousands of TIME_WAITs on a busy
    test machine, too slow to read every 2 ms). A Unix socket's path: the socket file's identity
    (each epoch binds the path anew once its parent shut its admin)."""
    if isinstance(admin, str):
        try:
            st = os.stat(admin)
        except OSError:
            return frozenset()
        return frozenset([(st.st_dev, st.st_ino)])
    port = admin
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    try:
        # inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid.
        req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
        req += struct.pack("!HH", port, 0) + b"\0" * 32 + struct.pack("=I", 0) + b"\xff" * 8
        hdr = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        s.sendto(hdr + req, (0, 0))
        found = set()
        while True:
            data = s.recv(1 << 16)
            if not data:
                return frozenset(found)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == NLMSG_DONE:
                    return frozenset(found)
                if kind == NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag refused the dump")
                # inet_diag_msg: family, state, timer, retrans, sockid (sport first), ..., inode.
                (sport,) = struct.unpack_from("!H", data, off + 16 + 4)
                (inode,) = struct.unpack_from("=I", data, off + 16 + 68)
                if sport == port:
                    found.add(inode)
                off += (length + 3) & ~3
    finally:
        s.close()


READY_REQUEST = b"GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
LINGER_RESET = struct.pack("ii", 1, 0)
MAX_IN_FLIGHT = 500


class Poller(threading.Thread):
    """An observer of Envoy's admin independent of the agent: every 2 ms it opens a NEW
    connection and sends GET /ready (each bounded by 1 s), without waiting for the earlier ones:
    a request held in a starting Envoy's accept queue does not delay the next. Connections are
    closed with a reset, leaving no TIME_WAIT behind at 500 a second. Each tick it also notes
    whether the admin port's listening socket of the epoch serving at arm() still exists.

    The new epoch's first 200 is the earliest 200 to a request started after the switch: after
    the old epoch's admin listener was seen gone, or after a non-200 (refused, reset, 503) was
    answered. Waiting for a non-200 alone misses most restarts: the gap between the old epoch
    closing its admin and the new one binding it is often under 2 ms, and requests made after
    that wait in the new epoch's accept queue and get 200 once it serves."""

    def __init__(self, admin):
        super().__init__(daemon=True)
        self.port = admin  # a TCP port, or a Unix socket's path
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.generation = 0
        self.old_inodes = frozenset()
        self.records = []  # (started, answered, status or None), wall times
        self.gone_at = None  # wall time the old epoch's admin listener was first seen gone

    def arm(self):
        """Start a new observation: forget the records, remember the admin's listening socket."""
        inodes = listen_inodes(self.port)
        with self.lock:
            self.generation += 1
            self.old_inodes = inodes
            self.records = []
            self.gone_at = None
        return inodes

    def run(self):
        sel = selectors.DefaultSelector()
        in_flight = {}  # socket -> [started wall, deadline monotonic, generation, received]
        next_at = time.monotonic()
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_at:
                    next_at = max(next_at + POLL_INTERVAL_S, now)
                    with self.lock:
                        generation, old = self.generation, self.old_inodes
                        watching = bool(old) and self.gone_at is None
                    if watching and not (old & listen_inodes(self.port)):
                        gone = time.time()
                        with self.lock:
                            if self.generation == generation and self.gone_at is None:
                                self.gone_at = gone
                    if len(in_flight) < MAX_IN_FLIGHT:
                        unix = isinstance(self.port, str)
                        s = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
                        if not unix:
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
                        s.setblocking(False)
                        started = time.time()
                        code = s.connect_ex(self.port if unix else ("127.0.0.1", self.port))
                        in_flight[s] = [started, now + 1.0, generation, b""]
                        sel.register(s, selectors.EVENT_WRITE)
                        if code not in (0, errno.EINPROGRESS):
                            self._finish(sel, in_flight, s, None)
                timeout = max(0.0, next_at - time.monotonic())
                if not in_flight:
                    time.sleep(timeout)
                    continue
                for key, events in sel.select(timeout):
                    s = key.fileobj
                    entry = in_flight[s]
                    status, done = None, True
                    try:
                        if events & selectors.EVENT_WRITE:
                            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                                s.send(READY_REQUEST)
                                sel.modify(s, selectors.EVENT_READ)
                                done = False
                        else:
                            chunk = s.recv(1024)
                            entry[3] += chunk
                            if chunk and b"\r\n" not in entry[3]:
                                done = False
                            elif chunk:
                                m = re.match(rb"HTTP/1\.[01] (\d{3})", entry[3])
                                status = int(m.group(1)) if m else None
                    except OSError:
                        pass
                    if done:
                        self._finish(sel, in_flight, s, status)
                now = time.monotonic()
                for s in [s for s, e in in_flight.items() if e[1] <= now]:
                    self._finish(sel, in_flight, s, None)
        finally:
            for s in list(in_flight):
                sel.unregister(s)
                s.close()
            sel.close()

    def _finish(self, sel, in_flight, s, status):
        started, _, generation, _ = in_flight.pop(s)
        sel.unregister(s)
        s.close()
        answered = time.time()
        with self.lock:
            if generation == self.generation:
                self.records.append((started, answered, status))

    def summary(self, t):
        """Run-length summary of the answers to requests started since t, in the order they
        came, e.g. `200x120 Nonex1 200x9`, with the longest wait of each run."""
        with self.lock:
            records = sorted((r for r in self.records if r[0] >= t), key=lambda r: r[1])
            gone = self.gone_at
        runs = []
        for started, answered, status in records:
            key = ("(gone)" if gone is not None and started >= gone else "") + str(status)
            if runs and runs[-1][0] == key:
                runs[-1][1] += 1
                runs[-1][2] = max(runs[-1][2], answered - started)
            else:
                runs.append([key, 1, answered - started])
        return " ".join(f"{k}x{n}(<={w * 1000:.0f}ms)" for k, n, w in runs) or "nothing"

    def live_after(self, t):
        """(wall time of the new epoch's first 200, whether a non-200 was seen), or None if not
        yet seen. Final once found: answers still to come are later."""
        with self.lock:
            records = [r for r in self.records if r[0] >= t]
            switch = self.gone_at
        failures = [answered for _, answered, status in records if status != 200]
        if failures:
            switch = min(failures) if switch is None else min(switch, min(failures))
        if switch is None:
            return None
        lives = [answered for started, answered, status in records if status == 200 and started >= switch]
        return (min(lives), bool(failures)) if lives else None


# ---------------------------------------------------------------------------------------------
# The runs


class Bench:
    def __init__(self, args, workdir, tracker):
        self.args = args
        self.workdir = workdir
        self.t = tracker

    def rundir(self, size, name):
        d = os.path.join(self.workdir, f"{size.name}-{name}")
        os.makedirs(d, exist_ok=True)
        return d

    def envoy_alone(self, size):
        d = self.rundir(size, "alone")
        argv = [self.args.envoy, "-c", size.path, "--concurrency", "1", "--base-id", str(self.t.base_id()),
                "-l", "warning"]
        t0 = time.monotonic()
        proc = self.t.popen(argv, os.path.join(d, "envoy.log"))
        wait_for("alone: Envoy /ready 200", lambda: http_status(size.admin_port) == 200,
                 self.args.ready_timeout_s, interval=0.1, alive=proc)
        ready_s = time.monotonic() - t0
        log(f"{size.name} alone: ready after {ready_s:.1f} s; idle window {self.args.idle_s:g} s")
        time.sleep(SETTLE_S)
        cpu = measure_cpu([proc.pid], self.args.idle_s)[proc.pid]
        rss = status_kib(proc.pid, "VmRSS")
        stop(proc)
        return {"ready_s": ready_s, "envoy_idle_cpu_s": cpu,
                "envoy_idle_cpu_share": cpu / self.args.idle_s if cpu is not None else None,
                "envoy_rss_mib": rss / 1024 if rss is not None else None}

    def agent_argv(self, size, d, node, extra=()):
        argv = [self.args.agent, "--log-format", "json", "run", "-c", size.path,
                "--envoy-path", self.args.envoy,
                "--status-address", "127.0.0.1:0",
                "--status-address-file", os.path.join(d, "status-address"),
                "--grpc-address", "unix:" + os.path.join(d, "grpc.sock")]
        if node:
            argv += ["--hot-restart", "--base-id", str(self.t.base_id()),
                     "--state-dir", os.path.join(d, "state"),
                     "--ready-marker", os.path.join(d, "ready"),
                     "--drain-time", "1s", "--parent-shutdown-time", "2s"]
        argv += list(extra)
        argv += ["--", "--concurrency", "1"]
        return argv

    def start_agent(self, size, d, node, extra=(), env=None):
        argv = self.agent_argv(size, d, node, extra)
        agent_log = AgentLog(os.path.join(d, "agent.log"))
        t0 = time.monotonic()
        proc = self.t.popen(argv, agent_log.path, env)
        what = f"{size.name} {'node' if node else 'sidecar'}"
        try:
            # Where the agent put Envoy's admin: its socket (a node proxy's default) or the
            # bootstrap's port.
            placed = wait_for(f"{what}: the agent places Envoy's admin",
                              lambda: [e for e in agent_log.read()
                                       if e.get("event") in ("envoy_admin", "envoy_admin_open")][:1],
                              self.args.ready_timeout_s, interval=0.05, alive=proc)[0]
            agent_log.admin = placed.get("path", size.admin_port)
            wait_for(f"{what}: Envoy /ready 200", lambda: http_status(agent_log.admin) == 200,
                     self.args.ready_timeout_s, interval=0.1, alive=proc)
        except RuntimeError:
            self.tail(agent_log)
            raise
        ready_s = time.monotonic() - t0
        envoys = wait_for(f"{what}: Envoy as the agent's child",
                          lambda: serving_envoys(proc.pid, self.args.envoy), 10, alive=proc)
        envoy_pid = max(envoys, key=envoys.get)
        log(f"{what}: ready after {ready_s:.1f} s (agent {proc.pid}, Envoy {envoy_pid})")
        return proc, agent_log, envoy_pid, ready_s

    def settle(self, proc):
        """Sleep SETTLE_S during which the agent runs no check of its own (an `envoy --mode
        validate` ahead of the next restart, after the first epoch is LIVE): bounded."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        while True:
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < SETTLE_S:
                if helper_envoys(proc.pid, self.args.envoy):
                    quiet_since = time.monotonic()
                if time.monotonic() > deadline:
                    log(f"the agent {proc.pid} kept running Envoy checks: measuring anyway")
                    return
                time.sleep(0.1)
            return

    def tail(self, agent_log, n=15):
        try:
            with open(agent_log.path, errors="replace") as f:
                lines = f.readlines()[-n:]
        except OSError:
            return
        log("agent log tail:\n  " + "  ".join(lines))

    def note_problems(self, size, mode, agent_log):
        for e in agent_log.problems():
            brief = {k: v for k, v in e.items() if k not in ("target", "span", "spans", "threadName", "threadId")}
            log(f"NOTE {size.name} {mode}: agent logged {json.dumps(brief)[:600]}")

    def idle_under_agent(self, size, node):
        mode = "node" if node else "sidecar"
        d = self.rundir(size, mode)
        proc, agent_log, envoy_pid, ready_s = self.start_agent(size, d, node)
        try:
            self.settle(proc)
            kids_before = children_cpu_s(proc.pid)
            cpu = measure_cpu([envoy_pid, proc.pid], self.args.idle_s)
            kids_after = children_cpu_s(proc.pid)
            result = {
                "ready_s": ready_s,
                "envoy_idle_cpu_s": cpu[envoy_pid],
                "envoy_idle_cpu_share": cpu[envoy_pid] / self.args.idle_s if cpu[envoy_pid] is not None else None,
                "agent_idle_cpu_s": cpu[proc.pid],
                "agent_idle_reaped_children_cpu_s": (kids_after - kids_before)
                if kids_before is not None and kids_after is not None else None,
                "agent_rss_mib": (status_kib(proc.pid, "VmRSS") or 0) / 1024,
            }
            if node:
                result.update(self.hot_restarts(size, proc, agent_log))
            # One Prometheus scrape through the agent (Envoy's stats passed on): its size, and
            # what it does to the agent's peak memory.
            result.update(scrape(os.path.join(d, "status-address")))
            hwm = status_kib(proc.pid, "VmHWM")
            result["agent_peak_rss_mib"] = hwm / 1024 if hwm is not None else None
        finally:
            t0 = time.monotonic()
            code = stop(proc)
            self.note_problems(size, mode, agent_log)
        log(f"{size.name} {mode}: agent exited {code} {time.monotonic() - t0:.1f} s after SIGTERM")
        result["agent_stop_s"] = time.monotonic() - t0
        return result

    def scrapes(self, size):
        """What a Prometheus scrape through the agent costs Envoy: one of everything, one
        `?usedonly`, and two of everything at once (which the agent answers with one walk of
        Envoy's stats); medians of --scrape-repeats."""
        d = self.rundir(size, "scrape")
        proc, agent_log, envoy_pid, _ = self.start_agent(
            size, d, node=False, env={"ENVOY_AGENT_LOG_LEVEL": "debug"})
        address = os.path.join(d, "status-address")
        result = {}
        try:
            self.settle(proc)
            rss = status_kib(proc.pid, "VmRSS")
            result["agent_rss_before_mib"] = rss / 1024 if rss is not None else None
            for name, query, together in (("full", "", 1), ("usedonly", "usedonly", 1), ("full_x2", "", 2)):
                runs = []
                for _ in range(max(1, self.args.scrape_repeats)):
                    walks_before = len(agent_log.walks())
                    start = threading.Barrier(together)
                    answers = [None] * together

                    def one(i, query=query, start=start, answers=answers):
                        start.wait()
                        answers[i] = scrape(address, query)

                    threads = [threading.Thread(target=one, args=(i,)) for i in range(together)]
                    cpu_before = cpu_s(envoy_pid)
                    t0 = time.monotonic()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(timeout=120)
                    wall = time.monotonic() - t0
                    cpu_after = cpu_s(envoy_pid)
                    if any(a is None or a["scrape_mib"] is None for a in answers):
                        raise RuntimeError(f"{size.name} scrape {name}: a scrape failed")
                    runs.append({
                        "mib": statistics.mean(a["scrape_mib"] for a in answers),
                        # The share of the answers that had Envoy's stats.
                        "stats_up": statistics.mean(a["stats_up"] for a in answers),
                        "wall_s": wall,
                        "envoy_cpu_s": cpu_after - cpu_before
                        if cpu_before is not None and cpu_after is not None else None,
                        # A walk logs its event before its scrapes get their last bytes:
                        # all there by now.
                        "walks": len(agent_log.walks()) - walks_before,
                    })
                result[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]
                                if all(r[k] is not None for r in runs)}
                result[name]["walks_max"] = max(r["walks"] for r in runs)
                log(f"{size.name} scrape {name}: {result[name]}")
            hwm = status_kib(proc.pid, "VmHWM")
            result["agent_peak_rss_mib"] = hwm / 1024 if hwm is not None else None
        finally:
            stop(proc)
            self.note_problems(size, "scrape", agent_log)
        return result

    def hot_restarts(self, size, proc, agent_log):
        admin = agent_log.admin
        poller = Poller(admin)
        poller.start()
        seen_after, preflight_ms, caches, durations = [], [], [], []
        down_seen = 0
        try:
            for k in range(self.args.restarts):
                wait_for(f"{size.name} node: one Envoy before restart {k + 1}",
                         lambda: len(serving_envoys(proc.pid, self.args.envoy)) == 1,
                         self.args.ready_timeout_s, interval=0.1, alive=proc)
                if http_status(admin) != 200:
                    raise RuntimeError(f"{size.name} node: Envoy not ready before restart {k + 1}")
                done_before = len(agent_log.handoffs())
                if not poller.arm():
                    raise RuntimeError(f"{size.name} node: no socket listens on Envoy's admin {admin}")
                t_hup = time.time()
                os.kill(proc.pid, signal.SIGHUP)
                event = wait_for(f"{size.name} node: handoff {k + 1} logged",
                                 lambda: agent_log.handoffs()[done_before:][:1],
                                 self.args.ready_timeout_s, interval=0.05, alive=proc)[0]
                if event.get("outcome") != "live":
                    self.tail(agent_log)
                    raise RuntimeError(f"{size.name} node: restart {k + 1} ended {event.get('outcome')}: "
                                       f"{event.get('error')}")
                agent_at = parse_ts(event["timestamp"])
                try:
                    poller_at, saw_down = wait_for(f"{size.name} node: the poller sees restart {k + 1}",
                                                   lambda: poller.live_after(t_hup), 10, interval=0.01)
                    down_seen += saw_down
                except RuntimeError as e:
                    log(f"{e}: restart {k + 1} left out of the latency; the poller saw {poller.summary(t_hup)}")
                    poller_at = None
                if poller_at is not None:
                    seen_after.append((agent_at - poller_at) * 1000)
                preflight_ms.append(event.get("preflight_ms"))
                caches.append(event.get("preflight_cache"))
                durations.append(event.get("duration_ms"))
                log(f"{size.name} node: restart {k + 1}: epoch {event.get('epoch')} LIVE "
                    f"{event.get('duration_ms', 0):.0f} ms after SIGHUP; agent - poller = "
                    f"{'n/a' if poller_at is None else f'{(agent_at - poller_at) * 1000:.1f} ms'}; "
                    f"pre-flight {event.get('preflight_ms', 0):.1f} ms ({event.get('preflight_cache')}); "
                    f"poller: {poller.summary(t_hup)}")
            if self.args.restarts:
                wait_for(f"{size.name} node: the old epoch exits after the last restart",
                         lambda: len(serving_envoys(proc.pid, self.args.envoy)) == 1,
                         self.args.ready_timeout_s, interval=0.1, alive=proc)
        finally:
            poller.stopping.set()
            poller.join(timeout=5)

        def med(xs):
            xs = [x for x in xs if x is not None]
            return float(statistics.median(xs)) if xs else None

        def mx(xs):
            xs = [x for x in xs if x is not None]
            return float(max(xs)) if xs else None

        return {
            "restarts": float(self.args.restarts),
            "live_seen_after_poller_ms_median": med(seen_after),
            "live_seen_after_poller_ms_max": mx(seen_after),
            "live_seen_after_poller_samples": float(len(seen_after)),
            "poller_saw_not_ready_restarts": float(down_seen),
            "preflight_hit_ms_median": med(preflight_ms),
            "preflight_hit_ms_max": mx(preflight_ms),
            "preflight_cache": caches,
            "handoff_duration_ms_median": med(durations),
            "handoff_duration_ms_max": mx(durations),
        }

    def agent_has_flag(self, flag):
        """Whether the agent under test knows `flag` (an older release may not)."""
        out = subprocess.run([self.args.agent, "run", "--help"], capture_output=True, text=True)
        return flag in out.stdout

    def drain(self, size, node):
        mode = "node" if node else "sidecar"
        d = self.rundir(size, mode + "-drain")
        extra = ["--exit-on-zero-active-connections", "--minimum-drain-duration", "0s",
                 "--termination-drain-duration", "12s"]
        # A drain held open by the idle connection for the whole window: the drain notice
        # would have Envoy close it within seconds (docs/shutdown.md, "What each client is
        # told"), and the window measures what a held drain costs.
        if self.agent_has_flag("--drain-notice"):
            extra += ["--drain-notice", "off"]
        proc, agent_log, envoy_pid, _ = self.start_agent(size, d, node, extra)
        conn = None
        try:
            conn = socket.create_connection(("127.0.0.1", size.listener_ports[0]), timeout=5)
            conn.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
            answer = read_http_response(conn)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{size.name} {mode} drain: listener 0 answered {answer[:80]!r}")
            self.settle(proc)
            t0 = time.monotonic()
            e0, a0 = cpu_s(envoy_pid), cpu_s(proc.pid)
            e_last, a_last, t_last = e0, a0, t0
            proc.send_signal(signal.SIGTERM)
            # Read every 0.5 s so that an Envoy stopped before the window ends still counts.
            while time.monotonic() - t0 < DRAIN_WINDOW_S:
                time.sleep(min(0.5, max(0.0, DRAIN_WINDOW_S - (time.monotonic() - t0))))
                e, a = cpu_s(envoy_pid), cpu_s(proc.pid)
                if e is None:
                    break
                e_last, a_last, t_last = e, (a if a is not None else a_last), time.monotonic()
            window = t_last - t0
            envoy_left = cpu_s(envoy_pid) is not None and proc.poll() is None
            if not envoy_left:
                log(f"{size.name} {mode} drain: Envoy was gone {window:.1f} s after SIGTERM "
                    f"(the idle connection did not hold the drain)")
            conn.close()
            conn = None
            t_close = time.monotonic()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log(f"{size.name} {mode} drain: agent still running 60 s after the connection closed")
            exit_s = time.monotonic() - t_close
            code = stop(proc)
            log(f"{size.name} {mode} drain: agent exited {code}, {exit_s:.1f} s after the connection closed")
            return {
                "drain_envoy_cpu_share": (e_last - e0) / window if window > 0 else None,
                "drain_agent_cpu_share": (a_last - a0) / window if window > 0 else None,
                "drain_window_s": window,
                "drain_exit_after_close_s": exit_s,
                "drain_exit_code": float(code) if code is not None else None,
            }
        finally:
            if conn is not None:
                conn.close()
            stop(proc)
            self.note_problems(size, mode + " drain", agent_log)


def read_http_response(conn):
    data = b""
    deadline = time.monotonic() + 5
    while b"\r\n\r\n" not in data:
        if time.monotonic() > deadline:
            break
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.search(rb"(?i)content-length:\s*(\d+)", head)
    want = int(m.group(1)) if m else 0
    while len(body) < want and time.monotonic() < deadline:
        chunk = conn.recv(4096)
        if not chunk:
            break
        body += chunk
    return data


def validate(envoy, path):
    t0 = time.monotonic()
    r = subprocess.run([envoy, "--mode", "validate", "-c", path, "-l", "error"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"envoy --mode validate rejects {path}:\n{(r.stdout + r.stderr)[-3000:]}")
    return took


# ---------------------------------------------------------------------------------------------
# Report


def flatten(result, prefix=""):
    rows = {}
    for k, v in result.items():
        if isinstance(v, dict):
            rows.update(flatten(v, f"{prefix}{k}."))
        else:
            rows[prefix + k] = v
    return rows


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(str(x) for x in v) or "-"
    if isinstance(v, float):
        if v.is_integer():
            return str(int(v))
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}"
        return f"{v:.4f}"
    return str(v)


def table(sizes):
    small, large = flatten(sizes.get("small", {})), flatten(sizes.get("large", {}))
    keys = list(dict.fromkeys(list(small) + list(large)))
    rows = [("measurement", "small", "large", "growth")]
    for k in keys:
        s, l = small.get(k), large.get(k)
        growth = "-"
        if isinstance(s, (int, float)) and isinstance(l, (int, float)) and s:
            growth = f"{l / s:.2f}x"
        rows.append((k, fmt(s), fmt(l), growth))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}")
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def floats(obj):
    if isinstance(obj, dict):
        return {k: floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [floats(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float)):
        return float(obj)
    return obj


def envoy_version(envoy):
    try:
        out = subprocess.run([envoy, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version:\s*(\S+)", out)
    return m.group(1) if m else (out.strip() or None)


def git_commit():
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)

    def on_sigterm(signum, frame):
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)

    # Short: the node proxy's hot-restart socket lives under it (sun_path holds 108 bytes).
    workdir = tempfile.mkdtemp(prefix="esb-")
    tracker = Tracker(workdir)
    names = [args.only] if args.only else ["small", "large"]
    shapes = {"small": args.small, "large": args.large}
    sizes = {}
    failed = False
    try:
        taken = set()
        configs = {n: Size(n, *shapes[n], workdir, taken) for n in names}
        for n, size in configs.items():
            took = validate(args.envoy, size.path)
            print(f"{n}: {size.listeners} listeners, {size.clusters} clusters, {size.bytes} bytes; "
                  f"envoy --mode validate accepts it in {took:.2f} s", flush=True)
            sizes[n] = {"listeners": float(size.listeners), "clusters": float(size.clusters),
                        "bootstrap_bytes": float(size.bytes), "validate_s": took}
        bench = Bench(args, workdir, tracker)
        for n, size in configs.items():
            log(f"=== {n}: {size.listeners} listeners, {size.clusters} clusters")
            if args.scrapes_only:
                sizes[n]["scrape"] = bench.scrapes(size)
                continue
            sizes[n]["alone"] = bench.envoy_alone(size)
            sizes[n]["sidecar"] = bench.idle_under_agent(size, node=False)
            sizes[n]["node"] = bench.idle_under_agent(size, node=True)
            sizes[n]["sidecar"].update(bench.drain(size, node=False))
            sizes[n]["node"].update(bench.drain(size, node=True))
            sizes[n]["scrape"] = bench.scrapes(size)
    except (KeyboardInterrupt, Interrupted) as e:
        log(f"interrupted ({str(e) or 'Ctrl-C'}): stopping everything")
        failed = True
    except Exception as e:  # noqa: BLE001 - reported, then everything is stopped
        log(f"failed: {type(e).__name__}: {e}")
        failed = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        tracker.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep_dir:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if sizes:
        print(table(sizes), flush=True)
    if args.json and sizes:
        report = {
            "sizes": floats(sizes),
            "machine": {"nproc": os.cpu_count(), "envoy_version": envoy_version(args.envoy)},
            "commit": git_commit(),
            "complete": not failed,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
