"""Listening TCP sockets of a process tree, read from Linux's /proc (for tests/launch/test_listening.py)."""
import os, socket, struct

def descendants(root):
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop(); out.append(p); todo += children.get(p, [])
    return out

def _addr(hex_addr, v6):
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if v6:
        raw = b"".join(raw[i:i+4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)

def listening(pids):
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    found = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        for line in open(f"/proc/net/{name}").readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                found.append((inodes[f[9]],) + _addr(f[1], v6))
    return found
