"""TLS on client connections and cluster routes, config includes and reloads.

Every test runs its own nats-server(s) on random ports with certificates made
here: a CA, and a server certificate for ``localhost`` / ``127.0.0.1`` signed
by it (used by both nodes of the cluster, for clients and routes alike).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import re
import ssl
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from joynexus.broker.connection import Broker
from joynexus.ops.runtime.natsconfig import ClusterOptions, TlsFiles
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.errors import JoyNexusError, Unavailable

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path

    def server_files(self, *, verify_clients: bool = False) -> TlsFiles:
        return TlsFiles(str(self.cert), str(self.key), str(self.ca), verify_clients)

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _make_pki(root: Path) -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "joynexus test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        # Routes present this certificate as clients too.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    pki = Pki(ca=root / "ca.pem", cert=root / "server.pem", key=root / "server-key.pem")
    pki.ca.write_bytes(_pem(ca))
    pki.cert.write_bytes(_pem(cert))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pki.key.chmod(0o600)
    return pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    return _make_pki(d)


class LogLines:
    """Collects a server's log lines through ``on_log_line`` (the ring buffer is short)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)


async def _poll(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


# --- client TLS ------------------------------------------------------------------


async def test_client_tls_required_and_verified(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    with EmbeddedNats(tmp_path / "nats", tls=pki.server_files()) as server:
        assert server.url.startswith("tls://127.0.0.1:")
        assert "TLS required for client connections" in server.log_tail()

        # A client trusting the CA: a JetStream round trip.
        ns = f"tls{uuid.uuid4().hex[:6]}"
        b = await Broker.connect(
            server.url,
            name="tls-test",
            namespace=ns,
            tls=pki.client_context(),
            tls_hostname="localhost",
        )
        try:
            stream, subject = f"{ns}_s", f"{ns}.x"
            await b.js.add_stream(name=stream, subjects=[subject], max_msgs=10)
            ack = await b.js.publish(subject, b"over tls", timeout=5)
            assert ack.stream == stream and ack.seq == 1
            got = await b.js.get_msg(stream, ack.seq)
            assert got.data == b"over tls" and got.subject == subject
            await b.js.delete_stream(stream)
        finally:
            await b.close()

        # Plain text to the same port: the server announces that TLS is required
        # and hangs up on a client that goes on without it (no PONG).
        host, port = server.url.removeprefix("tls://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            info = await asyncio.wait_for(reader.readline(), 5)
            assert info.startswith(b"INFO ") and b'"tls_required":true' in info, info
            writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
            await writer.drain()
            rest = await asyncio.wait_for(reader.read(), 5)  # b"" once the server closes
            assert b"PONG" not in rest, rest
        finally:
            writer.close()
        # nats-py, given a nats:// URL and no TLS settings, upgrades by itself with
        # the system trust store, which does not know our CA: no connection either.
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(
                server.url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=3
            )

        # TLS that does not trust our CA: the server's certificate fails verification.
        untrusted = {"tls": ssl.create_default_context(), "tls_hostname": "localhost"}
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=3, **untrusted)
        # Through Broker.connect (which keeps retrying until initial_timeout_s): each
        # attempt is refused for the same reason, logged at debug.
        caplog.set_level(logging.DEBUG, logger="joynexus.broker.connection")
        with pytest.raises(Unavailable, match="cannot connect to NATS"):
            await Broker.connect(
                server.url, name="untrusted", namespace=ns, initial_timeout_s=2, **untrusted
            )
        attempts = [r.getMessage() for r in caplog.records if "untrusted" in r.getMessage()]
        assert attempts and all("CERTIFICATE_VERIFY_FAILED" in m for m in attempts), attempts


async def test_client_certificates_required_with_verify_clients(tmp_path: Path, pki: Pki) -> None:
    files = pki.server_files(verify_clients=True)
    with EmbeddedNats(tmp_path / "nats", tls=files) as server:
        assert "verify: true" in server.config_path.read_text()
        # With a client certificate signed by the CA: accepted.
        ctx = pki.client_context()
        ctx.load_cert_chain(str(pki.cert), str(pki.key))
        nc = await nats.connect(server.url, tls=ctx, tls_hostname="localhost")
        try:
            await nc.flush(timeout=5)
        finally:
            await nc.close()
        # Without one: the server ends the connection and says why.
        with pytest.raises((ConnectionError, ssl.SSLError)):
            await nats.connect(
                server.url,
                tls=pki.client_context(),
                tls_hostname="localhost",
                allow_reconnect=False,
                connect_timeout=3,
            )
        await _poll(
            lambda: "TLS handshake error: tls: client didn't provide a certificate"
            in server.log_tail(),
            5,
            "the server to refuse the certificate-less client",
        )


# --- cluster routes over TLS -------------------------------------------------------

_RID = re.compile(r" - (rid:\d+) - ")


def _tls_routes(lines: list[str], side: str) -> set[str]:
    """rids of routes whose TLS handshake (``side`` = server|client) completed."""
    started = {
        m.group(1)
        for line in lines
        if f"Starting TLS route {side} handshake" in line and (m := _RID.search(line))
    }
    done = {
        m.group(1)
        for line in lines
        if "TLS handshake complete" in line and (m := _RID.search(line))
    }
    return started & done


def _created_routes(lines: list[str]) -> set[str]:
    return {
        m.group(1)
        for line in lines
        if "Route connection created" in line and (m := _RID.search(line))
    }


async def test_cluster_routes_use_tls(tmp_path: Path, pki: Pki) -> None:
    logs = [LogLines(), LogLines()]
    tls = pki.server_files()
    # debug: route TLS handshakes are logged at DBG only. No JetStream: a
    # clustered JetStream node refuses to start without configured routes, and
    # node 1's route port is only known once it runs.
    n1 = EmbeddedNats(
        tmp_path / "n1",
        name="jnx-tls-n1",
        tls=tls,
        cluster=ClusterOptions(name="jnxtls", tls=tls),
        extra_config="debug: true\n",
        on_log_line=logs[0],
        jetstream=False,
    )
    with n1:
        cluster_conf = n1.config_path.read_text()
        assert "verify: true" in cluster_conf.split("cluster {", 1)[1]
        assert n1.route_url.startswith("nats-route://127.0.0.1:")
        n2 = EmbeddedNats(
            tmp_path / "n2",
            name="jnx-tls-n2",
            tls=tls,
            cluster=ClusterOptions(name="jnxtls", routes=(n1.route_url,), tls=tls),
            extra_config="debug: true\n",
            on_log_line=logs[1],
            jetstream=False,
        )
        with n2:
            kw = {"tls": pki.client_context(), "tls_hostname": "localhost"}
            c1 = await nats.connect(n1.url, name="pub", **kw)
            c2 = await nats.connect(n2.url, name="sub", **kw)
            try:
                subject = f"route.{uuid.uuid4().hex[:8]}"
                sub = await c2.subscribe(subject)
                await c2.flush()
                # The subscription reaches node 1 once the route is up: publish
                # until a message crosses.
                deadline = time.monotonic() + 10
                received = None
                while received is None:
                    assert time.monotonic() < deadline, "no message crossed the route"
                    await c1.publish(subject, b"across")
                    await c1.flush()
                    try:
                        received = await sub.next_msg(timeout=0.2)
                    except nats.errors.TimeoutError:
                        continue
                assert received.data == b"across"
            finally:
                await c1.close()
                await c2.close()

            # Every route each node created went through a TLS handshake: node 1
            # accepted them (server side), node 2 dialed them (client side).
            await _poll(lambda: bool(_created_routes(logs[0].lines())), 5, "node 1's route")
            for lines, side in ((logs[0].lines(), "server"), (logs[1].lines(), "client")):
                created = _created_routes(lines)
                assert created, "\n".join(lines)
                assert created <= _tls_routes(lines, side), "\n".join(lines)
                assert any(
                    re.search(r"rid:\d+ - TLS version 1\.[23], cipher suite", line)
                    for line in lines
                )


async def test_plaintext_route_is_refused_by_a_tls_cluster(tmp_path: Path, pki: Pki) -> None:
    tls_node = LogLines()
    with EmbeddedNats(
        tmp_path / "n1",
        name="jnx-tls-a",
        cluster=ClusterOptions(name="jnxtls", tls=pki.server_files()),
        on_log_line=tls_node,
        jetstream=False,
    ) as n1:
        with EmbeddedNats(
            tmp_path / "n2",
            name="jnx-plain-b",
            cluster=ClusterOptions(name="jnxtls", routes=(n1.route_url,)),
            jetstream=False,
        ):
            refused = "TLS route handshake error: tls: first record does not look like a TLS"
            await _poll(
                lambda: any(refused in line for line in tls_node.lines()),
                10,
                "the TLS node to refuse the plaintext route",
            )
            assert not _created_routes(tls_node.lines()), "\n".join(tls_node.lines())


# --- includes, reloads, the config file, log callbacks ---------------------------


def _auth(user: str, password: str) -> str:
    return f'authorization {{ users = [ {{ user: "{user}", password: "{password}" }} ] }}\n'


async def _can_connect(url: str, user: str, password: str) -> bool:
    try:
        nc = await nats.connect(
            url, user=user, password=password, allow_reconnect=False, connect_timeout=2
        )
    except Exception as e:
        assert "authorization violation" in str(e).lower(), repr(e)
        return False
    await nc.close()
    return True


@pytest.mark.parametrize("absolute", [False, True], ids=["bare-name", "absolute-path"])
async def test_auth_include_and_reload(tmp_path: Path, absolute: bool) -> None:
    data = tmp_path / "nats"
    data.mkdir()
    if absolute:
        auth = tmp_path / "secrets" / "auth.conf"  # outside data_dir
        auth.parent.mkdir()
        include = str(auth)
    else:
        auth = data / "auth.conf"
        include = "auth.conf"
    auth.write_text(_auth("alice", "one"))
    with EmbeddedNats(data, auth_include=include) as server:
        text = server.config_path.read_text()
        assert re.search(r'^include "(?!/)[^"]*auth\.conf"$', text, re.M), text
        assert await _can_connect(server.url, "alice", "one")
        assert not await _can_connect(server.url, "bob", "two")

        auth.write_text(_auth("bob", "two"))
        await asyncio.to_thread(server.reload)
        assert await _can_connect(server.url, "bob", "two")
        assert not await _can_connect(server.url, "alice", "one")


async def test_reload_applies_changed_options_and_reports_failures(tmp_path: Path) -> None:
    data = tmp_path / "nats"
    data.mkdir()
    (data / "auth.conf").write_text("")
    with EmbeddedNats(data, auth_include="auth.conf") as server:
        # A changed option, written into the config by reload().
        server.max_payload = 4 * 1024 * 1024  # the default is 2 MiB
        server.reload()
        assert "max_payload: 4194304" in server.config_path.read_text()
        nc = await nats.connect(server.url)
        try:
            assert nc.max_payload == 4 * 1024 * 1024
        finally:
            await nc.close()
        # Reloads in a row, and from two threads at once, each wait for their own
        # confirmation (one SIGHUP at a time).
        server.reload()
        await asyncio.gather(asyncio.to_thread(server.reload), asyncio.to_thread(server.reload))
        assert server.log_tail(200).count("Reloaded server configuration") == 4

        # A broken include: the server keeps running and logs why; reload raises.
        (data / "auth.conf").write_text("authorization { users = [ { user: a, password: \n")
        with pytest.raises(JoyNexusError, match="Failed to reload server configuration"):
            server.reload(timeout=5)
        (data / "auth.conf").write_text("")
        server.reload()  # and it recovers
    with pytest.raises(JoyNexusError, match="not running"):
        server.reload()


def test_config_file_is_private(tmp_path: Path) -> None:
    data = tmp_path / "nats"
    data.mkdir()
    conf = data / "nats-server.conf"
    conf.write_text("# left over\n")
    conf.chmod(0o644)
    with EmbeddedNats(data) as server:
        assert stat.S_IMODE(os.stat(server.config_path).st_mode) == 0o600
        server.reload()
        assert stat.S_IMODE(os.stat(server.config_path).st_mode) == 0o600
        assert server.url.startswith("nats://")


def test_on_log_line_sees_every_line_and_survives_errors(tmp_path: Path) -> None:
    seen: list[str] = []

    def callback(line: str) -> None:
        seen.append(line)
        raise RuntimeError("a broken callback")

    with EmbeddedNats(tmp_path / "nats", on_log_line=callback) as server:
        server.reload()  # the pump is still alive: it saw the confirmation
        assert any("Reloaded server configuration" in line for line in seen)
        assert seen == server.log_tail(len(seen)).splitlines()
        assert any("Server is ready" in line for line in seen)


async def test_secured_deployment_over_tls(tmp_path: Path, pki: Pki) -> None:
    """Authorization and TLS together, as `joynexus up --tls-cert ...` runs them: the
    generated credentials files carry the CA, so agents, operators and tenants
    connect with TLS without further options; a client that does not trust the CA
    cannot connect."""
    from joynexus.agents.control import ControlPlane
    from joynexus.broker.credentials import Credentials
    from joynexus.ops.admin.tenants import add_tenant, list_tenants
    from joynexus.ops.runtime.deploy import embedded
    from joynexus.schemas.errors import Unavailable
    from joynexus.sdk import Client

    async def no_init(record: object) -> str:
        raise AssertionError("no workload is created here")

    with embedded(tmp_path / "d", tls=pki.server_files(), act_as_admin=False) as ep:
        assert ep.url.startswith("tls://") and ep.admin and ep.service
        saved = Credentials.load(tmp_path / "d" / "credentials" / "service.json")
        assert saved.ca_file == str(pki.ca) and ep.admin.ca_file == str(pki.ca)
        service = await Broker.connect(ep.url, name="svc", credentials=ep.control)
        admin = await Broker.connect(ep.url, name="op", credentials=ep.admin)
        control = ControlPlane(service, init_policy=no_init)  # type: ignore[arg-type]
        await control.start()
        try:
            creds, reply = await add_tenant(admin, "acme", url=ep.url, ca_file=ep.admin.ca_file)
            assert reply.applied == "yes" and creds.ca_file == str(pki.ca)
            acme = await Client.connect(credentials=creds)
            assert await acme.list_workloads() == []
            assert [t.tenant_id for t in await list_tenants(admin)] == ["acme"]
            await acme.close()
            untrusted = Credentials(user=ep.admin.user, password=ep.admin.password)
            with pytest.raises(Unavailable):
                await Broker.connect(ep.url, name="x", credentials=untrusted, initial_timeout_s=2)
        finally:
            await control.stop()
            await service.close()
            await admin.close()


async def test_launcher_config_file_turns_tls_on(tmp_path: Path, pki: Pki) -> None:
    """`joynexus server --config launcher.toml`: TLS from the launcher's config; the
    credentials it generates reach it over TLS; a bad key is a clear error."""
    import asyncio
    import signal
    import sys

    from joynexus.broker.credentials import Credentials

    cfg = tmp_path / "launcher.toml"
    cfg.write_text(
        "[server]\n"
        "port = -1\n"
        f'tls_cert = "{pki.cert}"\n'
        f'tls_key = "{pki.key}"\n'
        f'tls_ca = "{pki.ca}"\n'
    )
    data = tmp_path / "d"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "joynexus.ops.cli", "server", "--config", str(cfg),
        "--data-dir", str(data), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("nats-server ready at tls://127.0.0.1:"), line
        url = line.split()[3]
        admin = Credentials.load(data / "credentials" / "admin.json")
        assert admin.ca_file == str(pki.ca)
        b = await Broker.connect(url, name="op", credentials=admin)
        assert (await b.js.account_info()) is not None
        await b.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0  # SIGTERM stops it cleanly (auth sync, then the server)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\ntls_certificate = 'x'\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "joynexus.ops.cli", "server", "--config", str(bad),
        "--data-dir", str(data), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and "unknown options ['tls_certificate']" in err.decode()
