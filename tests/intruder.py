#!/usr/bin/env python3
"""An unprivileged process on the node, after an Envoy family's hot-restart channel.

Run as another user (uid 65534) in the agent's network namespace. It tries what Envoy's
channel allows anyone who can reach it (docs/security.md, "Security: who can reach what"):
take a listening socket (PassListenSocket, answered with the fd over SCM_RIGHTS) and stop
Envoy (Terminate), at every name the family's epochs could use, Envoy's abstract default and
the agent's private files alike; and it tries to take the node's epoch lock. It prints one JSON
object: what worked.

    intruder.py BASE_ID LISTENER_PORT STATE_DIR [LOCK_SECONDS]
"""

import array
import errno
import fcntl
import json
import os
import socket
import struct
import sys
import tempfile
import time

ABSTRACT_LEN = 107  # sun_path less the leading NUL, as Envoy pads its names


def field(number, payload):
    """A length-delimited protobuf field (small lengths only)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def framed(message):
    return struct.pack(">Q", len(message)) + message


def pass_listen_socket(address):
    # HotRestartMessage { request { pass_listen_socket { address } } }
    return framed(field(1, field(1, field(1, address.encode()))))


TERMINATE = framed(field(1, field(5, b"")))


def names(prefix_kind, prefix, id_):
    """(parent, child) addresses of channel `prefix` for socket id `id_`."""
    if prefix_kind == "abstract":
        def name(role, n):
            raw = f"{prefix}_{role}_{n}".encode()
            return b"\0" + raw + b"\0" * (ABSTRACT_LEN - len(raw))
    else:
        def name(role, n):
            return f"{prefix}_{role}_{n}"
    base, epoch = divmod(id_, 10)
    child = base * 10 + (epoch + 1) % 3
    return name("parent", id_), name("child", child)


def try_hijack(parent, child, address):
    """Asks `parent` for the listening socket of `address`, from `child`'s name."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind(child)
    except OSError as e:
        return f"bind child: {errno.errorcode.get(e.errno, e.errno)}"
    try:
        s.sendto(pass_listen_socket(address), parent)
    except OSError as e:
        return f"send: {errno.errorcode.get(e.errno, e.errno)}"
    s.settimeout(1.0)
    fds = array.array("i")
    try:
        _, ancillary, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4 * fds.itemsize))
    except OSError as e:
        return f"no answer: {e}"
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return "GOT_LISTENER" if len(fds) else "answered without a socket"


def try_terminate(parent):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(TERMINATE, parent)
        return "SENT"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def try_lock(path, seconds):
    try:
        f = open(path, "rb")
    except OSError as e:
        return f"open: {errno.errorcode.get(e.errno, e.errno)}"
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return f"flock: {errno.errorcode.get(e.errno, e.errno)}"
    time.sleep(seconds)
    return "HELD"


def main():
    base_id, port, state_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    lock_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    address = f"tcp://127.0.0.1:{port}"
    # The agent's short name for its channel (a symlink to the state dir's), in a directory
    # of the agent's user's.
    link = os.path.join(tempfile.gettempdir(), f"envoy-agent-hr-{os.stat(state_dir).st_uid}",
                        str(base_id), "envoy")
    channels = [("abstract", "envoy_domain_socket"), ("file", f"{state_dir}/hot-restart/envoy"),
                ("link", link)]
    result = {"hijack": {}, "terminate": {}, "uid": os.getuid()}
    for kind, prefix in channels:
        for n in range(3):
            id_ = base_id * 10 + n
            parent, child = names(kind, prefix, id_)
            key = f"{kind}:{id_}"
            result["hijack"][key] = try_hijack(parent, child, address)
            result["terminate"][key] = try_terminate(parent)
    result["lock"] = try_lock(f"{state_dir}/epoch.lock", lock_seconds)
    result["got_listener"] = any(v == "GOT_LISTENER" for v in result["hijack"].values())
    result["terminate_sent"] = any(v == "SENT" for v in result["terminate"].values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
