"""A real PostgreSQL server for the tests: ``initdb`` + ``pg_ctl start`` on a temporary directory and a free port.

The binaries come from ``STROP_PG_BIN`` (a directory), else ``pg_ctl`` on ``PATH``, else Debian's
``/usr/lib/postgresql/<version>/bin`` (``apt-get install -y postgresql``). PostgreSQL refuses to run as root,
so under root the server runs as the ``postgres`` user the Debian package creates (else ``nobody``), with its
data directory handed to that user. Each test gets a database of its own (:meth:`PostgresServer.new_database`).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

SUPERUSER = "strop"


def find_bin_dir() -> Path | None:
    if os.environ.get("STROP_PG_BIN"):
        given = Path(os.environ["STROP_PG_BIN"])
        return given if (given / "pg_ctl").is_file() and (given / "initdb").is_file() else None
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(os.path.realpath(on_path)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="strop-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres" if _user_exists("postgres") else "nobody"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> None:
        kw = {} if self.user is None else {"user": self.user, "group": pwd.getpwnam(self.user).pw_gid}
        proc = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=self.dir, **kw
        )
        if proc.returncode != 0:
            log = (self.dir / "server.log").read_text() if (self.dir / "server.log").exists() else ""
            raise RuntimeError(
                f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}{log}"
            )

    def start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--no-sync")
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-o", options, "start"
        )
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
