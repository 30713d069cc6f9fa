#!/usr/bin/env python3
"""bench/netns_exec.py NS CMD...: runs CMD as an Open MPI rank inside the
network namespace NS (`ip netns`), for bench/netns.sh. mpirun's PMIx server
listens on 127.0.0.1 of the namespace mpirun runs in, which a rank inside NS
cannot reach (its 127.0.0.1 is NS's own), so this process relays: it listens
on NS's 127.0.0.1 at a port of its own, pipes each connection to the server,
and points CMD's PMIX_SERVER_URI* variables at itself. Only PMIx's few
messages (start-up, fences) pass through it; MPI's traffic goes over the
namespace's interfaces. It exits with CMD's status and passes on the signals
mpirun sends."""
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading

CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


def setns(fd, what):
    if libc.setns(fd, CLONE_NEWNET) != 0:
        sys.exit(f"netns_exec.py: setns({what}): {os.strerror(ctypes.get_errno())}")


def pipe(src, dst):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (dst, src):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def relay(listener, server):
    while True:
        conn, _ = listener.accept()
        up = socket.create_connection(server)
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: netns_exec.py NS CMD...")
    ns, cmd = sys.argv[1], sys.argv[2:]
    uri = next((v for k, v in os.environ.items() if k.startswith("PMIX_SERVER_URI")), "")
    m = re.search(r"tcp4://([0-9.]+):([0-9]+)", uri)
    if not m:
        sys.exit(f"netns_exec.py: no tcp4 PMIX_SERVER_URI in the environment ('{uri}'): run under mpirun")
    server = (m[1], int(m[2]))
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    except OSError as e:
        sys.exit(f"netns_exec.py: network namespace {ns}: {e.strerror} (bench/netns.sh up creates it)")
    setns(target, ns)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    setns(home, "back")
    port = listener.getsockname()[1]
    env = dict(os.environ)
    for k, v in env.items():
        if k.startswith("PMIX_SERVER_URI"):
            env[k] = v.replace(f"tcp4://{server[0]}:{server[1]}", f"tcp4://127.0.0.1:{port}")
    threading.Thread(target=relay, args=(listener, server), daemon=True).start()
    child = subprocess.Popen(["ip", "netns", "exec", ns] + cmd, env=env)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    rc = child.wait()
    sys.exit(128 - rc if rc < 0 else rc)


main()
