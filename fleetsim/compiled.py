"""The simulator's hot modules compiled with mypyc: the same source, about 3x as fast.

    fairlane simulate --compiled workload.yaml ...   # builds once (~1-2 min), then reuses
    python -m fleetsim.compiled                      # build now; prints the directory

What is compiled (`MODULES`) is the source the interpreted run executes, unchanged:
the production scheduler core (`dispatcher.scheduler`, all of it, and the pool
configuration it reads, `fairlane.poolconfig`), the simulator
engine's batching core and step model, the worker's pull-room rule, and fleetsim's
event loop, event queue, state, recorder and arrival streams. mypyc turns each module
into a C extension; a compiled run gives the same result as an interpreted one, event
for event (`tests/integration/test_sim_compiled.py` compares the summaries).

Never in place: the build is a copy of the four packages (`fairlane`, `dispatcher`,
`gpu_worker`, `fleetsim`) with the extensions beside their source, in a cache
directory keyed by a hash of that source, the Python build and mypy's version. Only
a process whose PYTHONPATH starts with it imports the compiled modules (`env`):
the product's processes and the test suite keep the interpreted ones, because
compiled classes refuse what they do (an interpreted subclass of a compiled class,
patching a method).

Needs mypy (`pip install -e '.[sim]'`) and a C compiler with Python's headers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

# The packages the simulator imports from, copied whole (their .py files and data).
PACKAGES = ("fairlane", "dispatcher", "gpu_worker", "fleetsim")
# What mypyc compiles (paths in the copy): everything an event touches, so that
# compiled code calls compiled code, the arrival streams included (processes.py);
# not the workload file's parsing (workload.py), which runs once.
MODULES = (
    "dispatcher/scheduler/*.py",
    "gpu_worker/room.py",
    "gpu_worker/sim/batch.py",
    "gpu_worker/sim/step_model.py",
    "gpu_worker/sim/prefix_cache.py",
    "fleetsim/fleet.py",
    "fleetsim/events.py",
    "fleetsim/processes.py",
    "fleetsim/state.py",
    "fleetsim/records.py",
    "fleetsim/recorder.py",
    "fleetsim/histogram.py",
    # SchedulerConfig.tenant / weight: ~10 calls a request from the scheduler core
    # (its msgspec Structs live apart, in fairlane/poolspec.py, which mypyc cannot build).
    "fairlane/poolconfig.py",
)
# Build leftovers beside the source: neither copied nor part of the key.
_LEFTOVER_DIRS = ("__pycache__", "build")
_LEFTOVER_SUFFIXES = (".so", ".pyd", ".pyc", ".c")
_SKIP = shutil.ignore_patterns(*_LEFTOVER_DIRS, *(f"*{s}" for s in _LEFTOVER_SUFFIXES))
_MARKER = ".built"


class CompileError(RuntimeError):
    """mypyc could not build the modules (missing mypy or C compiler, a type error)."""


def source_root() -> Path:
    """Where the packages' source lives (the checkout, or site-packages)."""
    return Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    base = os.environ.get("FAIRLANE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fairlane")
    return Path(base) / "mypyc"


def _files(root: Path) -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*")):
            inside = p.relative_to(root).parts
            if p.is_file() and p.suffix not in _LEFTOVER_SUFFIXES and not any(
                    d in inside for d in _LEFTOVER_DIRS):
                out.append(p)
    return out


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        raise CompileError("mypyc is not installed: pip install -e '.[sim]' "
                           "(or pip install mypy)") from None


def build_key(root: Path | None = None) -> str:
    """Hash of what the build depends on: every copied file, Python, mypy."""
    root = root or source_root()
    h = hashlib.sha256()
    h.update(f"{sys.version}|{sys.platform}|{_mypy_version()}|{MODULES}".encode())
    for p in _files(root):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build(root: Path | None = None, quiet: bool = False) -> Path:
    """The compiled copy's directory, building it if this source has none yet."""
    root = root or source_root()
    dest = cache_root() / build_key(root)
    if (dest / _MARKER).exists():
        return dest
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        raise CompileError("no C compiler found (mypyc needs one: apt-get install gcc)")
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for pkg in PACKAGES:
            shutil.copytree(root / pkg, tmp / pkg, ignore=_SKIP)
        modules = sorted(str(p.relative_to(tmp)) for m in MODULES for p in tmp.glob(m))
        if not quiet:
            print(f"compiling {len(modules)} simulator modules with mypyc into {dest} "
                  "(once for this source; a minute or two)", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "mypyc", *modules], cwd=tmp,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             check=False)
        if out.returncode != 0:
            tail = "\n".join(out.stdout.splitlines()[-30:])
            raise CompileError(f"mypyc failed ({out.returncode}):\n{tail}")
        shutil.rmtree(tmp / "build", ignore_errors=True)
        (tmp / _MARKER).write_text(" ".join(modules) + "\n")
        try:
            tmp.rename(dest)
        except OSError:  # another process built the same key meanwhile: theirs is as good
            if not (dest / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def env(build_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python imports the compiled copy first; the source root
    after it, for what the copy lacks (a checkout's `bench`, which results files'
    provenance comes from)."""
    e = dict(os.environ if base is None else base)
    e["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(build_dir), e.get("PYTHONPATH", ""), str(source_root())) if p)
    return e


def is_compiled() -> bool:
    """Whether this process runs the compiled modules (the event loop's tells)."""
    import fleetsim.fleet

    return not (fleetsim.fleet.__file__ or "").endswith(".py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetsim.compiled",
                                 description="Build the compiled simulator; print its directory.")
    ap.parse_args(argv)
    try:
        print(build())
    except CompileError as exc:
        print(f"fleetsim.compiled: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
