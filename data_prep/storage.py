"""Object storage: a folder addressed by URI, through pyarrow's filesystems. Datasets (`vitpipe shard ...
s3://bucket/prefix`, `data.train: s3://...`), checkpoints and exports live there on a cluster whose nodes
share no disk.

    store = Store("s3://bucket/experiments/demo/pretrain")       # or gs://, hdfs://, file:///shared/...
    store.upload(Path("runs/demo/pretrain/checkpoints/step_00000100/rank_1.pt"), "checkpoints/step_00000100/rank_1.pt")
    store.download_dir("export", Path("/tmp/export"))

Training never reads or writes object storage directly: DeepSpeed saves into the node-local run
directory, then each rank uploads the files it wrote, and resume downloads a checkpoint onto each
node before DeepSpeed loads it. So the checkpoint shards of all ranks land in one place whether or
not the nodes share a filesystem.

Credentials and endpoints come from the environment, never from configs: pyarrow reads the standard
variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, or instance
roles; GOOGLE_APPLICATION_CREDENTIALS for gs://). S3 options that are not secret may ride in the URI's
query (`s3://bucket/prefix?endpoint_override=minio:9000&scheme=http&region=us-east-1`). Schemes that
pyarrow lacks but an installed fsspec implementation has (az://, abfs://, ...) go through fsspec.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote, urlsplit

import obstore
import pyarrow.fs as pafs
from obstore.store import S3Store

from data_prep import atomic

log = logging.getLogger(__name__)


def is_uri(location: str | os.PathLike | None) -> bool:
    """True for `scheme://...` locations (file:// included), False for plain paths."""
    return location is not None and "://" in str(location)


def _refuse_credentials(uri: str) -> None:
    """Keys written into a URI (s3://KEY:SECRET@bucket/...) would reach logs, manifests and the index."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        where = f"{parts.scheme}://{parts.hostname or ''}{parts.path}"
        raise ValueError(
            f"{where}: the URI carries credentials; give them through the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, instance roles, GOOGLE_APPLICATION_CREDENTIALS), never in a URI"
        )


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    _refuse_credentials(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except ValueError as exc:  # pyarrow's ArrowInvalid
        if "Unrecognized filesystem type" not in str(exc):
            # a scheme pyarrow has, used wrongly (a misspelt query option): say so, never fall back to an
            # fsspec implementation that would drop the option and talk to another endpoint
            raise ValueError(f"storage URI {uri.split('?', 1)[0]!r}: {exc}") from None
        scheme = urlsplit(uri).scheme
        try:
            import fsspec  # optional: only for schemes pyarrow lacks (az://, abfs://, ...)

            fs = fsspec.filesystem(scheme)
        except (ImportError, ValueError) as fs_exc:
            raise ValueError(
                f"storage URI {uri.split('?', 1)[0]!r}: neither pyarrow ({exc}) nor fsspec ({fs_exc}) has a filesystem for "
                f"{scheme}://; install its fsspec package (e.g. adlfs for az://)"
            ) from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), uri.split("://", 1)[1].split("?", 1)[0]


@functools.lru_cache(maxsize=32)
def _bucket_filesystem(base: str) -> pafs.FileSystem:
    return _filesystem(base)[0]


def _locate(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of one file's URI. On s3:// and gs:// one filesystem per bucket and query
    is made once per process and reused: making one costs more than reading a small image (and may ask
    the bucket's region), and the loader and the shard workers open one file after another."""
    _refuse_credentials(uri)
    parts = urlsplit(uri, allow_fragments=False)  # '#' may be part of an object key
    if parts.scheme in ("s3", "gs"):
        fs = _bucket_filesystem(
            f"{parts.scheme}://{parts.netloc}" + (f"?{parts.query}" if parts.query else "")
        )
        return fs, unquote(parts.netloc + parts.path)  # as pyarrow reads a URI: s3://b/a%20b.jpg is "a b.jpg"
    store = Store(uri)
    return store.fs, store.root


def open_stream(uri: str, buffer_size: int = 1 << 20):
    """A buffered sequential reader of the file at `uri` (a shard); a missing one raises FileNotFoundError."""
    fs, path = _locate(uri)
    return fs.open_input_stream(path, buffer_size=buffer_size)


def read_object(uri: str) -> bytes:
    """The whole file or object at `uri`; a missing one raises FileNotFoundError.

    s3:// objects are read with obstore (Rust's object_store): one GET per object. pyarrow's S3 reader
    sends a HEAD before each GET, which doubles the requests the store serves, and spends twice the client
    CPU (bench/s3_read.py, 60 kB objects against a local S3 server: 0.48 against 1.1 ms client and 2.5
    against 4.5 ms server CPU per object; boto3 sends one GET but spends 1.6 ms and holds the GIL while it
    parses, time a shard worker's decoding waits). A corpus of hundreds of millions of images is read
    once per sharding, so this is the request count that matters. obstore is given the settings pyarrow resolved for the bucket (endpoint, region,
    addressing) and takes credentials from the environment as pyarrow does (variables, web identity,
    container and instance roles). Buckets obstore cannot read as pyarrow would are read through pyarrow:
    credentials in a shared profile (AWS_PROFILE, ~/.aws/...), which object_store does not read; an
    assumed role, CA file or proxy given to pyarrow; other schemes. And where obstore fails on a read that
    pyarrow then makes, that bucket is read through pyarrow from then on, with one warning."""
    fast = _fast_reader(uri)
    if fast is not None:
        store, key, base = fast
        try:
            return bytes(obstore.get(store, key).bytes())
        except FileNotFoundError:
            raise
        except Exception as exc:  # obstore's own error types: retried below with pyarrow
            data = _pyarrow_read(uri)  # pyarrow's error, the one users know, where it fails too
            with _FAST_LOCK:  # a worker's read-ahead threads may all have failed at once: one warning
                first = _FAST.get((os.getpid(), base)) is not None
                _FAST[(os.getpid(), base)] = None
            if not first:
                return data
            log.warning(
                "%s: obstore could not read %s (%s); reading this bucket through pyarrow instead",
                base.split("?", 1)[0],
                key,
                (str(exc).splitlines() or [type(exc).__name__])[0][:300],
            )
            return data
    return _pyarrow_read(uri)


def _pyarrow_read(uri: str) -> bytes:
    fs, path = _locate(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


# (process, s3://bucket?query) -> its obstore store, or None where the bucket is read through pyarrow. Keyed by
# process: a store's runtime and connections must not cross a fork.
_FAST: dict[tuple[int, str], object] = {}
_FAST_LOCK = threading.Lock()

# pyarrow S3 options obstore is not given: they must be at pyarrow's defaults for obstore to read the bucket.
_S3_DEFAULTS = {
    "access_key": None,
    "secret_key": None,
    "session_token": None,
    "role_arn": "",
    "tls_ca_file_path": "",
}


def _fast_reader(uri: str) -> tuple[object, str, str] | None:
    """(obstore store, key, bucket base) for an s3:// URI obstore can read; None for everything else."""
    parts = urlsplit(uri, allow_fragments=False)
    if parts.scheme != "s3":
        return None
    _refuse_credentials(uri)
    base = f"s3://{parts.netloc}" + (f"?{parts.query}" if parts.query else "")
    slot = (os.getpid(), base)
    if slot not in _FAST:
        _FAST[slot] = None if _profile_credentials() else _obstore_for(_bucket_filesystem(base), parts.netloc)
    store = _FAST[slot]
    return None if store is None else (store, unquote(parts.path.lstrip("/")), base)


def _profile_credentials() -> str | None:
    """What points the AWS SDK (pyarrow) at a shared profile, which object_store does not read; None where
    credentials come from the variables, a web identity or container role, or the instance."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return None  # ahead of any profile in both chains
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return None
    for var in ("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        if env.get(var):
            return var
    for name in ("credentials", "config"):
        if (Path.home() / ".aws" / name).is_file():
            return f"~/.aws/{name}"
    return None


def _obstore_for(fs: pafs.FileSystem, bucket: str):
    """An obstore S3Store with the endpoint, region and addressing pyarrow resolved for `bucket` (from the
    URI's query, the environment, or by asking the bucket), or None where pyarrow holds settings obstore is
    not given (explicit keys, an assumed role, a CA file, a proxy)."""
    try:
        opts = fs.__reduce__()[1][0]  # the options pyarrow pickles the filesystem with
    except (AttributeError, IndexError, TypeError):
        return None
    if any(opts.get(k, v) != v for k, v in _S3_DEFAULTS.items()) or (opts.get("proxy_options") or {}).get(
        "host"
    ):
        return None
    endpoint = opts.get("endpoint_override") or ""
    if endpoint and "://" not in endpoint:
        endpoint = f"{opts.get('scheme') or 'https'}://{endpoint}"
    config: dict = {"region": opts.get("region") or "us-east-1"}
    if endpoint:
        config["endpoint"] = endpoint
    if opts.get("anonymous"):
        config["skip_signature"] = True
    if opts.get("force_virtual_addressing"):
        config["virtual_hosted_style_request"] = True
    client: dict = {"allow_http": endpoint.startswith("http://")}
    bundle = os.environ.get("AWS_CA_BUNDLE")  # a private CA the AWS SDK trusts (a self-hosted MinIO)
    if bundle:
        try:
            client["root_certificate"] = Path(bundle).read_bytes()
        except OSError:
            return None  # pyarrow names the file when it fails
    retry = {"max_retries": 5, "retry_timeout": timedelta(seconds=60)}
    try:
        return S3Store(bucket, config=config, client_options=client, retry_config=retry)
    except Exception:  # a setting obstore rejects (a bucket name it will not take): pyarrow reads
        return None


# Bytes per read when copying a file to or from a store (pyarrow's default: 1 MiB). A checkpoint shard is
# hundreds of MB: each read of an object store file is a ranged GET, and 1 MiB reads made a 1 GB
# ViT-B ZeRO-3 checkpoint 1000 requests (275 s to download from a local S3 server, bench/multinode.py).
COPY_CHUNK = 64 << 20


class Store:
    """A folder on local, shared or object storage; paths inside it are relative POSIX strings."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, root = _filesystem(uri)
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.uri.split('?', 1)[0]!r})"

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-folders of `rel` (object stores: common prefixes); [] when it does not exist."""
        if not self.exists(rel):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(rel), allow_not_found=True))
        return sorted(Path(i.path).name for i in infos if i.type == pafs.FileType.Directory)

    def list_files(self, rel: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(rel), allow_not_found=True))
        return sorted(Path(i.path).name for i in infos if i.type == pafs.FileType.File)

    def read_text(self, rel: str) -> str:
        with self.fs.open_input_stream(self._path(rel)) as f:
            return f.read().decode()

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A small file: one PUT on object stores (readers see the old object or the new one). Past the
        client's multipart threshold a failed write could leave a short object: its size is checked and
        a short one removed, as `upload` does."""
        with self._whole(rel, len(data)):
            with self.fs.open_output_stream(self._path(rel)) as f:
                f.write(data)

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None where there is none."""
        try:
            with self.fs.open_input_stream(self._path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def size(self, rel: str) -> int | None:
        """Bytes of the file `rel`, or None where there is no such file."""
        info = self.fs.get_file_info(self._path(rel))
        return info.size if info.type == pafs.FileType.File else None

    def open_input(self, rel: str):
        """A readable binary stream (sequential reads, buffered: unbuffered, every small read of an
        object store stream would be a ranged GET of its own)."""
        return self.fs.open_input_stream(self._path(rel), buffer_size=1 << 20)

    def open_file(self, rel: str):
        """A seekable binary file (random access: Parquet footers and row groups)."""
        return self.fs.open_input_file(self._path(rel))

    def delete_file(self, rel: str) -> None:
        """Remove the file `rel`; no error where there is none. s3:// objects are deleted with obstore where it
        reads the bucket (`read_object`): pyarrow PUTs an empty marker object for the folder a delete leaves,
        a stray object in the dataset's listing (and in .work/ after every build's clean-up)."""
        fast = _fast_reader(child(self.uri, rel)) if self.fs.type_name == "s3" else None
        if fast is not None:
            try:
                obstore.delete(fast[0], fast[1])  # S3's DeleteObject: no error for a missing key
                return
            except Exception:  # obstore's own error types: pyarrow tries, and raises its error
                pass
        try:
            self.fs.delete_file(self._path(rel))
        except FileNotFoundError:
            pass

    def upload(self, local: Path, rel: str) -> None:
        """Copy a complete local file to `rel`. Where the copy fails, what reached the store under `rel`
        is removed: pyarrow completes an object store upload even when the copy stops early (arrow
        issue 40502), so a short object would otherwise look whole."""
        with self._whole(rel, os.path.getsize(local)):
            pafs.copy_files(
                str(local),
                self._path(rel),
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.fs,
                chunk_size=COPY_CHUNK,
            )

    @contextmanager
    def _whole(self, rel: str, expected: int) -> Iterator[None]:
        """Around a write of `expected` bytes to `rel`: afterwards the file holds all of them, or is gone."""
        self._ensure_parent(rel)
        try:
            yield
            got = self.size(rel)
            if got != expected:
                raise OSError(f"{self.describe(rel)}: wrote {got} bytes of {expected}")
        except BaseException:
            try:
                self.delete_file(rel)
            except OSError:
                pass
            raise

    def describe(self, rel: str = "") -> str:
        """The URI of `rel` without its query (what a message names)."""
        base = self.uri.split("?", 1)[0].rstrip("/")
        return f"{base}/{rel}" if rel else base

    def download_file(self, rel: str, local: Path) -> Path:
        """Copy the file `rel` to `local` atomically (whole or absent); FileNotFoundError where there is none."""
        if self.size(rel) is None:
            raise FileNotFoundError(self.describe(rel))
        local.parent.mkdir(parents=True, exist_ok=True)
        with atomic.writing(local, shared=True) as tmp:  # nodes on one disk may fetch the same file at once
            self._copy_to_local(rel, tmp)
        return local

    def download_files(self, rel: str, names: list[str], local: Path, workers: int = 8) -> None:
        """Copy the files `names` of the folder `rel` into the folder `local`, `workers` at a time, each
        atomically (whole or absent); files of `local` not named stay as they are. Other processes may fetch
        the same files into the same folder at once (the nodes on one shared disk): the last copy wins."""
        local.mkdir(parents=True, exist_ok=True)

        def one(name: str) -> None:
            with atomic.writing(local / name, shared=True) as tmp:
                self._copy_to_local(f"{rel}/{name}" if rel else name, tmp)

        with ThreadPoolExecutor(max(1, min(workers, len(names)))) as pool:
            for future in [pool.submit(one, n) for n in names]:
                future.result()

    def _copy_to_local(self, rel: str, local: Path) -> None:
        pafs.copy_files(
            self._path(rel),
            str(local),
            source_filesystem=self.fs,
            destination_filesystem=pafs.LocalFileSystem(),
            chunk_size=COPY_CHUNK,
        )

    def download_dir(self, rel: str, local: Path) -> Path:
        """Copy the folder `rel` to `local` atomically: into a temporary sibling, then one rename.

        Returns `local`. If another process on this node put a complete copy there first, ours is
        discarded and theirs kept (both came from the same objects).
        """
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.", dir=local.parent))
        try:
            for name in self.list_files(rel):
                self._copy_to_local(f"{rel}/{name}" if rel else name, tmp / name)
            try:
                os.replace(tmp, local)  # fails if `local` is a non-empty folder: someone else won
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return local

    def delete_dir(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.delete_dir(self._path(rel))

    def _ensure_parent(self, rel: str) -> None:
        if self.fs.type_name in ("s3", "gcs"):
            # Object stores need no parents, and pyarrow would PUT an empty marker object for every
            # ancestor (bucket/, bucket/team/, ...): denied under a prefix-scoped IAM policy, and
            # rate-limited when many workers rewrite the same keys.
            return
        parent = self._path(rel).rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)


def child(uri: str, *parts: str) -> str:
    """`uri` with path parts appended, keeping its query (s3://b/p?x=1 -> s3://b/p/a/b?x=1)."""
    base, _, query = uri.partition("?")
    joined = "/".join([base.rstrip("/"), *parts])
    return f"{joined}?{query}" if query else joined
