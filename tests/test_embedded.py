"""The embedded redis-server: starts on demand, keeps data across a crash, and leaves no process behind."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from lbbsp import ConfigError, EmbeddedRedis, Store, StoreUnavailable, embedded
from lbbsp.embedded import (
    first_answering,
    ipv6_available,
    local_addresses,
    machine_identity,
    redis_server_binary,
    serve_embedded,
    temp_parent,
)
from lbbsp.store import wait_for_redis


def test_start_restart_and_clean_stop() -> None:
    server = EmbeddedRedis()
    pid, directory = server.pid, server.directory
    with Store.from_url(server.url, "embedded") as store:
        store.client.set("k", "v")
        server.restart(kill=True)  # SIGKILL: only the append-only file can carry the key over
        assert store.client.get("k") == b"v"
    server.close()
    server.close()  # safe twice
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not directory.exists()


def _server_in_a_child() -> tuple[subprocess.Popen[str], int, Path]:
    """Another process with its own embedded server; returns it, the server's pid and the server's folder."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import lbbsp, time; s = lbbsp.EmbeddedRedis(); print(s.pid, s.directory, flush=True); "
                               "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    pid, directory = child.stdout.readline().split()
    return child, int(pid), Path(directory)


def _wait_until_dead(redis_pid: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            if psutil.Process(redis_pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:  # gone, also between a check and the status read
            return
        assert time.monotonic() < deadline, "redis-server outlived its parent"
        time.sleep(0.05)


def test_the_server_dies_with_the_process_that_started_it() -> None:
    child, redis_pid, _ = _server_in_a_child()
    assert psutil.pid_exists(redis_pid)
    child.send_signal(signal.SIGKILL)
    child.wait()
    _wait_until_dead(redis_pid)


def test_unreachable_redis_gives_a_clear_error(tmp_path: os.PathLike) -> None:
    with Store.from_url(f"unix://{tmp_path}/nothing.sock", "j") as store:
        with pytest.raises(StoreUnavailable, match="cannot reach Redis"):
            store.ping()


def test_a_redis_that_needs_a_password_or_a_url_without_a_socket_says_so(tmp_path: Path) -> None:
    """A reachable Redis that refuses us was reported as "cannot reach Redis at ...: HELLO must be called with the
    client already authenticated..."; "unix://" with no socket as "cannot reach Redis at None:None"."""
    sock = tmp_path / "auth.sock"
    server = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", str(sock), "--requirepass",
                               "sekret", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for url, said in ((f"unix://{sock}", "needs a password, and the URL gives none"),
                          (f"unix://:wrong@{sock}", "refused the URL's password")):
            with Store.from_url(url, "j") as store, pytest.raises(StoreUnavailable, match=said):
                store.ping()
        with Store.from_url(f"unix://:sekret@{sock}", "j") as store:
            store.ping()
    finally:
        server.terminate()
        server.wait()
    with pytest.raises(ConfigError, match="names no socket"):
        Store.from_url("unix://", "j")


def test_a_redis_that_never_answers_is_named_without_its_password() -> None:
    with pytest.raises(StoreUnavailable, match=r"Redis at redis://:\*\*\*@127.0.0.1:1/0 did not answer") as raised:
        wait_for_redis("redis://:sekret@127.0.0.1:1/0", 0.2)
    assert "sekret" not in str(raised.value)


def _folder_with_a_dead_socket(*, age_s: float = 0.0) -> Path:
    """A folder shaped like an older lbbsp's (no owner label) whose server is gone: its socket refuses."""
    folder = Path(tempfile.mkdtemp(prefix="lbbsp-redis-", dir=temp_parent()))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(folder / "redis.sock"))  # closing without unlinking leaves a socket nobody listens on
    if age_s:
        os.utime(folder, (time.time() - age_s, time.time() - age_s))
    return folder


def test_start_removes_the_folders_of_killed_processes() -> None:
    child, redis_pid, killed = _server_in_a_child()
    child.send_signal(signal.SIGKILL)  # no atexit: the folder stays behind, its server dies with the child
    child.wait()
    unlabelled = _folder_with_a_dead_socket(age_s=3600)
    _wait_until_dead(redis_pid)  # else its socket would still answer and the folder would rightly be kept
    with EmbeddedRedis():
        assert not killed.exists()
        assert not unlabelled.exists()


def test_start_keeps_the_folders_that_may_still_be_in_use() -> None:
    child, _, other = _server_in_a_child()  # a live server of another process
    stopped = EmbeddedRedis()  # a live owner whose server is down for a moment: start() reuses the data
    stopped.stop(kill=True)
    just_made = _folder_with_a_dead_socket()  # no owner label yet: it may have been created a moment ago
    orphan = Path(tempfile.mkdtemp(prefix="lbbsp-redis-", dir=temp_parent()))  # owner gone, server still listening
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    (orphan / "owner").write_text(f"{dead_pid.pid} {os.readlink('/proc/self/ns/pid')}\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(orphan / "redis.sock"))
    listener.listen()
    try:
        with EmbeddedRedis():
            assert [folder for folder in (other, stopped.directory, just_made, orphan) if not folder.exists()] == []
        with Store.from_url(f"unix://{other}/redis.sock", "other") as store:
            store.ping()
    finally:
        listener.close()
        child.send_signal(signal.SIGTERM)
        child.wait()
        stopped.close()
        shutil.rmtree(just_made, ignore_errors=True)
        shutil.rmtree(orphan, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


def test_a_server_on_tcp_needs_its_password_and_keeps_port_and_data_across_a_restart() -> None:
    with EmbeddedRedis(listen="127.0.0.1") as server:
        conf = server.directory / "redis.conf"
        assert conf.stat().st_mode & 0o077 == 0  # the password file is this user's alone
        (url,) = server.peer_urls()
        assert url.startswith("redis://:") and url.endswith(f"@127.0.0.1:{server.port}/0")
        password = url.split("@")[0].removeprefix("redis://:")
        assert password not in Path(f"/proc/{server.pid}/cmdline").read_text()
        with Store.from_url(f"redis://127.0.0.1:{server.port}/0", "j") as anyone:
            with pytest.raises(StoreUnavailable, match="needs a password"):
                anyone.ping()
        with Store.from_url(url, "j") as tcp, Store.from_url(server.url, "j") as unix:
            tcp.client.set("k", "v")
            port = server.port
            server.restart(kill=True)
            assert server.port == port and tcp.client.get("k") == b"v" and unix.client.get("k") == b"v"
    with pytest.raises(ConfigError, match="unix socket only"), EmbeddedRedis() as plain:
        plain.peer_urls()
    with pytest.raises(ConfigError, match="port must be"):
        EmbeddedRedis(listen="127.0.0.1", port=70000)


def test_peers_find_a_server_on_all_interfaces_by_the_first_address_that_answers() -> None:
    with EmbeddedRedis(listen="0.0.0.0") as server:
        urls = server.peer_urls(toward="127.0.0.1")
        assert urls[-1] == server.tcp_url("127.0.0.1")  # loopback last, even where the route to the peer is loopback
        wrong = server.tcp_url("127.0.0.1").replace("redis://:", "redis://:x")
        assert first_answering(["redis://127.0.0.1:1/0", wrong, *urls[::-1]]) == urls[-1]
        with pytest.raises(StoreUnavailable, match=r"tried redis://127.0.0.1:1/0 \(ConnectionError\), "
                                                   r"redis://:\*\*\*@127.0.0.1:\d+/0 \(AuthenticationError\)"):
            first_answering(["redis://127.0.0.1:1/0", wrong])


def test_tcp_settings_that_would_open_the_server_or_cannot_work_are_refused_and_leave_no_folder() -> None:
    before = set(Path(temp_parent()).glob("lbbsp-redis-*"))
    with pytest.raises(ConfigError, match="give listen too"):  # a TCP port on every interface, with no password
        EmbeddedRedis(port=6390)
    for bad in ("not-an-address", "127.0.0.1 ::1", "0.0.0.0:6379"):
        with pytest.raises(ConfigError, match="one IPv4 or IPv6 address of this machine"):
            EmbeddedRedis(listen=bad)
    with pytest.raises(ConfigError, match="link-local, reached only with an interface named"):
        EmbeddedRedis(listen="fe80::1")
    with pytest.raises(ConfigError, match="not an address of this machine"):
        EmbeddedRedis(listen="203.0.113.7")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(StoreUnavailable, match=r"cannot listen on 127.0.0.1:\d+: another process holds that port"):
            EmbeddedRedis(listen="127.0.0.1", port=holder.getsockname()[1])
    assert set(Path(temp_parent()).glob("lbbsp-redis-*")) == before


def test_loopback_is_the_last_address_a_peer_tries() -> None:
    assert local_addresses("localhost")[-1] == "127.0.0.1"
    assert local_addresses("localhost").count("127.0.0.1") == 1
    assert local_addresses("::1", ipv6=True)[-2:] == ["127.0.0.1", "::1"]
    assert all(":" not in address for address in local_addresses("::1"))  # an IPv4 server is not offered by IPv6


def _global_ipv6() -> str:
    """A global IPv6 address of this machine (the test is skipped where there is none)."""
    if not ipv6_available():
        pytest.skip("this machine cannot listen on IPv6")
    found = [address for address in local_addresses(ipv6=True) if ":" in address and address != "::1"]
    if not found:
        pytest.skip("this machine has no global IPv6 address")
    return found[0]


def test_a_server_on_every_interface_is_reached_over_ipv6_and_ipv4_the_route_to_the_peer_first() -> None:
    """On an IPv6 network (MASTER_ADDR an IPv6 address), the address toward the peer comes first, in brackets."""
    address = _global_ipv6()
    with EmbeddedRedis(listen="::") as server:
        urls = server.peer_urls(toward=f"[{address}]")  # MASTER_ADDR may carry brackets
        assert urls[0] == server.tcp_url(address) and f"@[{address}]:{server.port}/" in urls[0]
        assert urls[-2:] == [server.tcp_url("127.0.0.1"), server.tcp_url("::1")]
        for url in urls:
            with Store.from_url(url, "j") as store:
                store.client.set("k", url)
        wrong = urls[0].replace("redis://:", "redis://:x")
        assert first_answering([wrong, urls[0]]) == urls[0]
    with EmbeddedRedis(listen=address) as server:
        assert server.peer_urls(toward="127.0.0.1") == [server.tcp_url(address)]
        with Store.from_url(server.peer_urls()[0], "j") as store:
            assert store.client.ping()


def test_the_machine_identity_tells_apart_what_shares_a_host_name_but_not_the_servers_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers with /dev/shm of their own (or cloned machines) may share a host name: such a peer cannot reach a
    unix socket in our folder, so it must count as another machine."""
    here = machine_identity()
    assert here == machine_identity() and here.startswith(socket.gethostname() + "/")
    if os.stat(tmp_path).st_dev == os.stat(temp_parent()).st_dev:
        pytest.skip("the temp dir and the servers' folder share a device here")
    monkeypatch.setattr("lbbsp.embedded.temp_parent", lambda: str(tmp_path))
    assert machine_identity() != here


def test_worker0_listens_on_every_interface_and_on_ipv4_alone_where_ipv6_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str | None] = []

    class Started:  # what worker 0's start gives back; the server itself is tested above
        url = "unix:///nowhere/redis.sock"

        def peer_urls(self, toward: str | None = None) -> list[str]:
            return []

    def start(listen: str | None) -> Started:
        asked.append(listen)
        return Started()

    for available in (True, False):
        monkeypatch.setattr(embedded, "ipv6_available", lambda available=available: available)
        assert serve_embedded(0, lambda value: [value], start, across=True)[1] == Started.url  # type: ignore[arg-type]
    assert serve_embedded(0, lambda value: [value], start)[1] == Started.url  # type: ignore[arg-type]
    assert asked == ["::", "0.0.0.0", None]  # one machine: the unix socket alone


def test_a_given_folder_is_kept_unless_the_server_owns_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedRedis(tmp_path / "kept"):
        pass
    assert any("appendonly" in path.name for path in (tmp_path / "kept").iterdir())  # the caller's data stays
    with EmbeddedRedis(tmp_path / "owned", own_directory=True) as server:
        assert (server.directory / "owner").read_text().split()[0] == str(os.getpid())  # a killed owner's is removed
    assert not (tmp_path / "owned").exists()
    monkeypatch.setattr(embedded, "redis_server_binary", lambda: "/bin/false")
    with pytest.raises(StoreUnavailable):
        EmbeddedRedis(tmp_path / "failed", listen="127.0.0.1", own_directory=True)
    assert not (tmp_path / "failed").exists()  # with the password's config file


def test_peers_are_offered_what_they_can_connect_to_and_loopback_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """IPv4 link-local (a direct cable) is offered; IPv6 link-local (it needs an interface named) is not; an
    IPv4-mapped address is the IPv4 one, so a mapped loopback still comes last."""
    def entry(family: int, address: str) -> SimpleNamespace:  # the fields psutil's entries have that are read
        return SimpleNamespace(family=family, address=address)

    interfaces = {"lo": [entry(socket.AF_INET, "127.0.0.1"), entry(socket.AF_INET6, "::1")],
                  "cable": [entry(socket.AF_INET, "169.254.10.1"), entry(socket.AF_INET6, "fe80::1%cable"),
                            entry(socket.AF_INET6, "fd00::5"), entry(socket.AF_INET6, "::ffff:10.0.0.3")]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {})
    assert local_addresses() == ["169.254.10.1", "127.0.0.1"]
    assert local_addresses("::ffff:127.0.0.1", ipv6=True) == ["169.254.10.1", "fd00::5", "10.0.0.3", "127.0.0.1",
                                                                "::1"]


def test_a_mapped_listen_address_is_served_as_ipv4_and_a_scope_id_is_refused() -> None:
    with EmbeddedRedis(listen="::ffff:127.0.0.1") as server:
        assert server.peer_urls() == [server.tcp_url("127.0.0.1")]
        with Store.from_url(server.peer_urls()[0], "j") as store:
            assert store.client.ping()
    with pytest.raises(ConfigError, match="names an interface"):
        EmbeddedRedis(listen="fd00::2%eth0")
