"""Do MASTER_ADDR and MASTER_PORT work for a rendezvous here?

Run by hand (standard library and torch only; copy the probes/ folder):

    MASTER_ADDR=node-1 MASTER_PORT=29500 python probes/rendezvous.py

(a plain python start checks the endpoint your job would use; under
`torchrun --nproc_per_node=2 probes/rendezvous.py` the launch itself holds
MASTER_PORT, so the port check is skipped and the store round trip goes
through torchrun's own store.)

Reports whether MASTER_ADDR resolves, to which addresses, whether they are
loopback (other nodes cannot reach 127.x), whether MASTER_PORT (default
29500) is free on this host and, if not, which process holds it, and
whether a TCPStore round trip on that endpoint works. When MASTER_ADDR is
another host, it tries a TCP connection instead.

If it hangs: name resolution is stuck (check /etc/resolv.conf and
/etc/hosts) or a firewall drops packets; the probe gives each step a few
seconds, so a hang points at the store connection.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

from _probekit import (
    connect,
    interfaces,
    is_loopback,
    main,
    one_line,
    resolve,
    under_runner,
    user_env,
)

NAME = "rendezvous"
DEFAULT_PORT = 29500  # torchrun's and init_process_group's default
DEFAULT_ADDR = "127.0.0.1"  # torchrun's default --master-addr
STORE_TIMEOUT = timedelta(seconds=5)


def collect(ctx) -> dict:
    """The user's rendezvous endpoint, checked from this rank's host."""
    addr_set, port_set = user_env("MASTER_ADDR"), user_env("MASTER_PORT")
    addr = addr_set or DEFAULT_ADDR
    port = _parse_port(port_set)
    lookup = resolve(addr)
    local = _local_addresses()
    facts = {
        "master_addr": addr_set,
        "master_port": port_set,
        "addr": addr,
        "port": port,
        "resolved": lookup["addresses"],
        "resolve_error": lookup["error"],
        "resolve_seconds": lookup["seconds"],
        "loopback": bool(lookup["addresses"]) and all(is_loopback(a) for a in lookup["addresses"]),
        "local": any(a in local or is_loopback(a) for a in lookup["addresses"]),
        "launch_store": _launch_store_round_trip(ctx.rank.rank),
    }
    ctx.checkpoint(facts)
    problems = []
    if lookup["error"]:
        problems.append(f"MASTER_ADDR {addr} does not resolve: {lookup['error']}")
    if port is None:
        problems.append(f"MASTER_PORT {port_set!r} is not a port number")
    if ctx.rank.local_rank == 0 and port is not None and not lookup["error"]:
        facts.update(_check_endpoint(addr, port, facts["local"]))
        problems.extend(_endpoint_problems(facts))
    facts["problems"] = problems
    facts["summary"] = f"{addr}:{port} -> {', '.join(lookup['addresses']) or lookup['error']}" + (
        f"; port free: {facts['port_free']}" if "port_free" in facts else ""
    )
    return facts


def _parse_port(text: str | None) -> int | None:
    if not text:
        return DEFAULT_PORT
    try:
        port = int(text)
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def _local_addresses() -> set[str]:
    addresses = set()
    for nic in interfaces():
        if nic["ipv4"]:
            addresses.add(nic["ipv4"])
        addresses.update(nic["ipv6"])
    return addresses


def _check_endpoint(addr: str, port: int, local: bool) -> dict:
    """Port and store checks, done by one rank per host (two would race)."""
    if not local:
        return {"connect": connect(addr, port)}
    if not under_runner() and os.environ.get("MASTER_PORT") == str(port):
        # By hand under torchrun, the launch's own store listens on this port.
        return {"port_free": None, "port_note": "held by this launch's own store"}
    free, error = port_free(port)
    result: dict = {"port_free": free, "port_error": error, "port_holder": None}
    if not free:
        result["port_holder"] = port_holder(port)
        return result
    result["store"] = _store_round_trip(addr, port)
    return result


def _endpoint_problems(facts: dict) -> list[str]:
    problems = []
    if facts.get("port_free") is False:
        holder = facts["port_holder"]
        who = f" (held by pid {holder['pid']}: {holder['cmdline']})" if holder else ""
        problems.append(f"port {facts['port']} is in use{who}")
    store = facts.get("store")
    if store and store["result"] != "ok":
        problems.append(
            f"store round trip on {facts['addr']}:{facts['port']} failed: {store['error']}"
        )
    if facts.get("connect") not in (None, "ok"):
        problems.append(f"cannot connect to {facts['addr']}:{facts['port']}: {facts['connect']}")
    return problems


def port_free(port: int) -> tuple[bool, str | None]:
    """Whether a server could listen on the port, as TCPStore would.

    SO_REUSEADDR like TCPStore, so a closed connection lingering in
    TIME_WAIT does not count as busy, while a live listener does.
    """
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno != errno.EADDRINUSE:
                continue  # IPv6 present but unusable: not a port conflict
            return False, one_line(exc)
        finally:
            sock.close()
    return True, None


def port_holder(port: int, budget: float = 1.0) -> dict | None:
    """The process listening on the port, where /proc lets us see it."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    deadline = time.monotonic() + budget
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or time.monotonic() > deadline:
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return {"pid": int(entry.name), "cmdline": _cmdline(entry)}
        except OSError:
            continue  # another user's process or one that just exited
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    return inodes


def _cmdline(entry: Path) -> str:
    try:
        text = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return one_line(text.strip(), limit=120)


def _store_round_trip(addr: str, port: int) -> dict:
    """Serve a TCPStore on the endpoint and talk to it as a client would."""
    import torch.distributed as dist

    started = time.monotonic()
    server = client = None
    try:
        server = dist.TCPStore(addr, port, None, True, STORE_TIMEOUT, wait_for_workers=False)
        client = dist.TCPStore(addr, port, None, False, STORE_TIMEOUT)
        client.set("ddp-assistant-probe", "ok")
        ok = server.get("ddp-assistant-probe") == b"ok"
        result = {"result": "ok" if ok else "failed", "error": None if ok else "value lost"}
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        result = {"result": "failed", "error": one_line(exc)}
    finally:
        del client, server  # closes the sockets and frees the port
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _launch_store_round_trip(rank: int) -> dict | None:
    """A set/get through the store of the current launch (torchrun's env://)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import torch.distributed as dist

    started = time.monotonic()
    try:
        store = dist.TCPStore(addr, int(port), None, False, STORE_TIMEOUT)
        key = f"ddp-assistant-probe/rendezvous/{rank}"
        store.set(key, "ok")
        result = "ok" if store.get(key) == b"ok" else "value lost"
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        result = one_line(exc)
    return {"result": result, "seconds": round(time.monotonic() - started, 3)}


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
