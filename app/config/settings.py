"""Settings of `run`, `chat`, `serve` and `gui`: every option from files, variables, profiles and flags.

Nothing here lists options by hand: the commands' own argparse parsers say which keys exist, how a
value converts (`type`) and what it may be (`choices`), so a new flag is configurable at once.
Precedence, lowest to highest:

    argparse default < --profile NAME < user colibri.toml < MODEL's colibri.toml < --config FILE
    < COLIBRI_<KEY> environment variables < flags given on the command line

A model file's [tuned] table (written by `colibri tune`, see app.config.tuned) sits just under the model file's
own keys, and only while its fingerprint matches this machine, the model and the memory budget.

The user file is `<user config dir>/colibri/colibri.toml` (~/.config/colibri on Linux); the model's
is `colibri.toml` in the model folder, or beside a .gguf file. An explicit --config wins over the
model's file, which wins over the user's: the more deliberate the choice, the higher it sits.
A file holds keys (a long option's name, with - or _) at top level for every command, or in a
[run] / [chat] / [serve] / [gui] table for one command; the table wins over the top level.
A variable is COLIBRI_ and the key in capitals (COLIBRI_MAX_MEMORY=9GB); an empty one counts as unset.
Switches (--no-history) take true or false, repeatable options (--stop) a list; values go through
the option's own type and choices, so a file is checked exactly as the flag would be.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from engine.errors import ColibriError

SETTINGS_COMMANDS = ("run", "chat", "serve", "gui")
FILE_NAME = "colibri.toml"
ENV_PREFIX = "COLIBRI_"
ORDER = "default < profile < user file < model file < --config < COLIBRI_* < flag"
TUNED = "tuned"                     # the model file's table of `colibri tune` (app.config.tuned)


@dataclass(frozen=True)
class Profile:
    """A named set of values for a kind of machine; keys a command lacks are skipped for it."""

    name: str
    summary: str
    values: Mapping[str, Any]


# The three set-ups of the reference article on big MoE models in small memory. None restores the
# argparse default (for speed: no --max-memory, so the model loads whole when the machine holds it).
PROFILES: Mapping[str, Profile] = MappingProxyType({p.name: p for p in (
    Profile("memory-saving", "a 16 GB machine: 12 GB for the model, int8 KV cache, 4096-token context",
            {"max_memory": "12GB", "kv_bits": 8, "ctx": 4096, "prefetch_depth": 1, "cache_policy": "learned"}),
    Profile("balanced", "a 32 GB machine: 26 GB for the model, exact KV cache, 8192-token context",
            {"max_memory": "26GB", "ctx": 8192, "kv_bits": 32, "prefetch_depth": 1}),
    Profile("speed", "no memory cap beyond the machine's: deeper read-ahead, more readers, speculative decoding",
            {"max_memory": None, "prefetch_depth": 2, "io_threads": 4, "speculative": True}),
)})


@dataclass(frozen=True)
class Setting:
    """One option's merged value and where it came from (`default`, `profile:NAME`, a file, a variable, `flag`)."""

    key: str                    # the argparse dest, e.g. max_memory
    value: Any
    source: str
    option: str                 # the flag, e.g. --max-memory


@dataclass(frozen=True)
class Resolved:
    """The merged settings of one command and the files read on the way."""

    command: str
    settings: Mapping[str, Setting]
    profile: Profile | None
    files: tuple[Path, ...] = field(default=())
    notices: tuple[str, ...] = field(default=())     # one line each, for stderr (tuned values ignored, ...)


# ---- threads ----------------------------------------------------------------------------------

_process_threads: int | None = None        # what apply_threads chose, for threads started later


def physical_cores(cpuinfo: Path = Path("/proc/cpuinfo")) -> int:
    """Physical cores this process may use: hyper-threads share one core's units and slow decoding."""
    pairs: set[tuple[str, str]] = set()
    try:
        package = "0"
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "processor":
                package = "0"
            elif key == "physical id":
                package = value.strip()
            elif key == "core id":
                pairs.add((package, value.strip()))
    except OSError:
        pass
    cores = len(pairs) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):        # a container or taskset may grant fewer CPUs than the host has
        cores = min(cores, len(os.sched_getaffinity(0)))
    return max(1, cores)


def positive_int(text: str) -> int:
    """A whole number of at least 1 (an argparse type, so that the flag and the files check it alike)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {value}")
    return value


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, --profile and --threads, each unless the command already has it."""
    have = parser._option_string_actions
    g = parser.add_argument_group("settings (see `colibri config show`)")
    if "--config" not in have:
        g.add_argument("--config", type=Path, metavar="FILE",
                       help=f"read settings from this TOML file; order: {ORDER}")
    if "--profile" not in have:
        g.add_argument("--profile", choices=tuple(PROFILES), default=None,
                       help="preset values: " + "; ".join(f"{p.name}: {p.summary}" for p in PROFILES.values()))
    if "--threads" not in have:
        cores = physical_cores()
        g.add_argument("--threads", type=positive_int, default=cores, metavar="N",
                       help=f"compute threads for numba kernels and BLAS (default: the physical cores, {cores} here)")


def apply_threads(threads: int, source: str = "flag") -> int:
    """Set numba's and BLAS's thread counts for this process; returns the count used.

    The default (the physical cores) is capped at the threads numba started with; a count the user
    asked for is refused instead, so that it is never silently less.
    """
    import numba
    import numpy  # noqa: F401 - loads the BLAS library, which threadpoolctl only sees once loaded
    from threadpoolctl import threadpool_limits

    most = numba.config.NUMBA_NUM_THREADS
    if threads > most:
        if source != "default":
            raise ColibriError(f"{source}: threads = {threads}, but numba started with at most {most} threads; "
                               f"ask for {most} or fewer, or start with NUMBA_NUM_THREADS={threads}")
        threads = most
    numba.set_num_threads(threads)
    threadpool_limits(limits=threads, user_api="blas")
    global _process_threads
    _process_threads = threads
    return threads


def use_process_threads() -> None:
    """Give the calling thread the count apply_threads chose: numba's count is per thread, new ones get all."""
    if _process_threads is not None:
        import numba

        numba.set_num_threads(_process_threads)


# ---- the parsers ------------------------------------------------------------------------------


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The registered parsers of SETTINGS_COMMANDS, by name (`serve` only once it exists)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {name: action.choices[name] for name in SETTINGS_COMMANDS if name in action.choices}
    return {}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options a file, a variable or a profile may set, by dest (positionals stay on the command line)."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))}


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str], command: argparse.ArgumentParser) -> set[str]:
    """The dests of `command`'s options given in argv: parsed again with every default suppressed."""
    saved = [(a, a.default) for a in command._actions]
    try:
        for action in command._actions:
            action.default = argparse.SUPPRESS
        given = vars(parser.parse_args(argv))
    finally:
        for action, default in saved:
            action.default = default
    return set(given) & set(options(command))


def flag_name(action: argparse.Action) -> str:
    """The long spelling of an option, e.g. --max-memory."""
    return max(action.option_strings, key=len)


# ---- values -----------------------------------------------------------------------------------

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_TYPE_NAMES = {int: "a whole number", float: "a number", str: "text", Path: "a path", positive_int: "a whole number >= 1"}


def _is_switch(action: argparse.Action) -> bool:
    """store_true / store_false / BooleanOptionalAction: the key takes the dest's true or false."""
    return isinstance(action, argparse.BooleanOptionalAction) or (
        action.nargs == 0 and isinstance(action.const, bool) and isinstance(action.default, bool))


def _takes_no_value(action: argparse.Action) -> bool:
    """store_true, store_false, store_const and their kin: the key says on (true) or off (false)."""
    return action.nargs == 0 and not isinstance(action, argparse._CountAction)


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._AppendAction, argparse._ExtendAction)) or action.nargs in ("*", "+") \
        or isinstance(action.nargs, int) and action.nargs > 0


def allowed(action: argparse.Action) -> str:
    """What an option accepts, in words: 'one of 32, 8', 'true or false', 'a whole number'."""
    if _takes_no_value(action):
        return "true or false"
    if action.choices is not None:
        one = "one of " + ", ".join(str(c) for c in action.choices)
    else:
        one = _TYPE_NAMES.get(action.type or str) or getattr(action.type, "description", None) \
            or f"a {getattr(action.type, '__name__', 'value')}"
    return f"a list of {one.removeprefix('a ')} (or one)" if _is_list(action) else one


def convert(action: argparse.Action, raw: Any, where: str, key: str) -> Any:
    """A file's, variable's or profile's value for `action`, converted and checked like the flag's text."""
    def bad() -> ColibriError:
        return ColibriError(f"{where}: {key} = {raw!r}: expected {allowed(action)}")

    if raw is None:                          # profiles only: back to the default
        return action.default
    if _takes_no_value(action):
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            raw_bool = raw.strip().lower() in _TRUE
        elif isinstance(raw, bool):
            raw_bool = raw
        else:
            raise bad()
        if _is_switch(action):
            return raw_bool
        return action.const if raw_bool else action.default      # store_const: on or off
    if _is_list(action):
        return [_scalar(action, item, bad) for item in (raw if isinstance(raw, list) else [raw])]
    if action.nargs == "?" and isinstance(action.const, bool) and isinstance(raw, bool):
        return action.const if raw else action.default      # a flag whose value is optional (--speculative [mtp])
    return _scalar(action, raw, bad)


def _scalar(action: argparse.Action, raw: Any, bad) -> Any:
    """One value through the option's own type, as if typed after the flag (a TOML 4.0 counts as 4)."""
    kind = int if isinstance(action, argparse._CountAction) else action.type
    whole = kind in (int, positive_int)
    if isinstance(raw, (bool, list, dict)) or whole and isinstance(raw, float) and not raw.is_integer():
        raise bad()
    text = str(int(raw)) if whole and isinstance(raw, float) else str(raw)
    try:
        value = kind(text) if kind is not None else text
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise bad() from None
    if action.choices is not None and value not in action.choices:
        raise bad()
    return value


# ---- the sources ------------------------------------------------------------------------------

Layer = dict[str, Setting]


def user_file() -> Path:
    """`<user config dir>/colibri/colibri.toml` (it need not exist)."""
    import platformdirs

    return Path(platformdirs.user_config_dir("colibri", appauthor=False)) / FILE_NAME


def model_path(model: str | None) -> Path | None:
    """MODEL's file or folder when MODEL is given and found (a path, or a pulled name; never downloads)."""
    if model is None:
        return None
    from app.config.catalog import find_model

    try:
        return find_model(model)
    except ColibriError:
        return None                          # the command itself says what is wrong with MODEL


def model_file(model: str | None) -> Path | None:
    """MODEL's colibri.toml (in its folder, or beside a .gguf) when MODEL is given and found."""
    path = model_path(model)
    return None if path is None else (path if path.is_dir() else path.parent) / FILE_NAME


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def read_file(path: Path, parsers: Mapping[str, argparse.ArgumentParser]) -> dict[str, Layer]:
    """Every command's values from one TOML file, checked against every command's options."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ColibriError(f"{path}: cannot read the settings file ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ColibriError(f"{path}: not valid TOML ({exc}); fix the file or remove it") from None
    by_command = {name: options(p) for name, p in parsers.items()}
    known = sorted({dest for opts in by_command.values() for dest in opts} - {"config"})
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and k != TUNED}   # [tuned]: tuned_layer
    _check_keys(path, str(path), top, known, " or ".join(f"`{c}`" for c in by_command))
    for name, table in tables.items():
        if name not in SETTINGS_COMMANDS:
            raise ColibriError(f"{path}: unknown table [{name}]{_suggest(name, list(SETTINGS_COMMANDS))} "
                               f"(tables: {', '.join(f'[{c}]' for c in SETTINGS_COMMANDS)})")
        if name in by_command:
            _check_keys(path, f"{path} [{name}]", table, sorted(set(by_command[name]) - {"config"}), f"`{name}`")
    layers: dict[str, Layer] = {}
    for name, opts in by_command.items():
        layer: Layer = {}
        for where, values in ((str(path), top), (f"{path} [{name}]", tables.get(name, {}))):
            for key, raw in values.items():
                dest = key.replace("-", "_")
                if dest in opts:
                    layer[dest] = Setting(dest, convert(opts[dest], raw, where, key), where, flag_name(opts[dest]))
        layers[name] = layer
    return layers


def _check_keys(path: Path, where: str, values: Mapping[str, Any], known: list[str], scope: str) -> None:
    seen: dict[str, str] = {}
    for key, raw in values.items():
        dest = key.replace("-", "_")
        if isinstance(raw, dict):
            raise ColibriError(f"{where}: [{key}] is a table inside a table; use [run], [chat], [serve] or [gui] "
                               "at the top of the file")
        if dest == "config":
            raise ColibriError(f"{where}: config = {raw!r}: a settings file cannot name another one; "
                               "pass --config FILE on the command line")
        if dest not in known:
            raise ColibriError(f"{where}: unknown key {key!r}{_suggest(dest, known)} (the keys are the long options "
                               f"of {scope}, with - or _; `colibri config show` lists them)")
        if dest in seen:
            raise ColibriError(f"{where}: {seen[dest]!r} and {key!r} are the same key; keep one")
        seen[dest] = key


def env_layer(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> Layer:
    """COLIBRI_<DEST> variables for the command's options; an empty variable counts as unset."""
    layer: Layer = {}
    for dest, action in options(parser).items():
        name = ENV_PREFIX + dest.upper()
        if env.get(name, "") != "":
            layer[dest] = Setting(dest, convert(action, env[name], "environment", name), f"env {name}",
                                  flag_name(action))
    return layer


def profile_layer(profile: Profile, parser: argparse.ArgumentParser) -> Layer:
    """The profile's values for the options this command has."""
    opts = options(parser)
    where = f"profile:{profile.name}"
    return {k: Setting(k, convert(opts[k], v, where, k), where, flag_name(opts[k]))
            for k, v in profile.values.items() if k in opts}


# ---- merging ----------------------------------------------------------------------------------


def resolve(command: str, parsers: Mapping[str, argparse.ArgumentParser], args: argparse.Namespace,
            given: set[str], env: Mapping[str, str] | None = None, user: Path | None = None) -> Resolved:
    """Merge every source for `command` in precedence order (see the module's docstring)."""
    env = os.environ if env is None else env
    parser = parsers[command]
    opts = options(parser)
    defaults = {k: Setting(k, a.default, "default", flag_name(a)) for k, a in opts.items()}
    flags = {k: Setting(k, getattr(args, k), "flag", flag_name(opts[k])) for k in given if k in opts}
    env_values = env_layer(parser, env)

    files: list[tuple[Path, Layer]] = []
    user = user_file() if user is None else user
    explicit = (flags.get("config") or env_values.get("config"))
    # MODEL's own file; a command whose MODEL defaults to the default model reads that model's when MODEL is left out
    model = model_path(getattr(args, "model", None) or getattr(args, "default_model", None))
    model_toml = model_file(str(model)) if model is not None else None
    for path in (user, model_toml):
        if path is not None and path.is_file():
            files.append((path, read_file(path, parsers)[command]))
    if explicit is not None:
        path = Path(explicit.value).expanduser()
        if not path.is_file():
            raise ColibriError(f"{explicit.source}: config = {str(explicit.value)!r}: no such file; "
                               "check the path (or drop the option)")
        files.append((path, read_file(path, parsers)[command]))

    layers = [layer for _, layer in files] + [env_values, flags]
    notices: list[str] = []
    if model is not None and model_toml is not None and model_toml.is_file():
        tuned, notice = tuned_layer(model_toml, model, parser, layers)
        if notice:
            notices.append(notice)
        if tuned:                                   # just under the model file's own keys
            layers.insert([path for path, _ in files].index(model_toml), tuned)
    chosen = next((layer["profile"] for layer in reversed(layers) if "profile" in layer), None)
    profile = PROFILES[chosen.value] if chosen is not None and chosen.value is not None else None
    if profile is not None:
        layers.insert(0, profile_layer(profile, parser))
    merged, rank = dict(defaults), dict.fromkeys(defaults, -1)
    for i, layer in enumerate(layers):
        for key, setting in layer.items():
            merged[key], rank[key] = setting, i
    _settle_exclusive(parser, merged, rank, defaults)
    return Resolved(command, MappingProxyType(merged), profile, tuple(path for path, _ in files), tuple(notices))


def for_model(parser: argparse.ArgumentParser, argv: list[str], command: str, model: str) -> argparse.Namespace:
    """The arguments of `colibri ARGV` with the settings of `command` merged as if MODEL had been given: how the
    app opens a model after it started (MODEL's colibri.toml in its place, under the same flags, variables and
    files). Quiet: no notices printed, the threads left as they are."""
    args = parser.parse_args(argv)
    args.model = model
    parsers = command_parsers(parser)
    resolved = resolve(command, parsers, args, explicit_dests(parser, argv, parsers[command]))
    for setting in resolved.settings.values():
        setattr(args, setting.key, setting.value)
    return args


def asked_for(parser: argparse.ArgumentParser, argv: list[str], command: str) -> set[str]:
    """The dests of `command` that `colibri ARGV` sets explicitly for this run: its flags and COLIBRI_* variables
    (not the settings files, which hold defaults a window's remembered sliders may override)."""
    parsers = command_parsers(parser)
    return explicit_dests(parser, argv, parsers[command]) | set(env_layer(parsers[command], os.environ))


def tuned_layer(path: Path, model: Path, parser: argparse.ArgumentParser, layers: list[Layer]) -> tuple[Layer, str]:
    """The [tuned] values of the model's colibri.toml for this command, and a notice; no values when the file
    has none or when its fingerprint differs from this machine's, model's and budget's (the notice says so)."""
    from app.config import tuned
    from app.config.sizes import parse_size

    try:
        table = tuned.from_data(path, tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}, ""                               # read_file has said what is wrong with the file
    if table is None:
        return {}, ""
    budget = next((layer["max_memory"].value for layer in reversed(layers) if "max_memory" in layer), None)
    current = tuned.fingerprint(model, parse_size(budget, "max_memory") if budget else None)
    changed = tuned.differences(table.fingerprint, current)
    if changed:
        again = f"colibri tune {model}" + (f" --max-memory {budget}" if budget else "")
        return {}, (f"{path}: tuned settings ignored, measured for another {', '.join(changed)}; "
                    f"run `{again}` to measure them again")
    opts = options(parser)
    where = f"{path} [{TUNED}]"
    return {k: Setting(k, convert(opts[k], v, where, k), where, flag_name(opts[k]))
            for k, v in table.values.items() if k in opts}, ""


def _settle_exclusive(parser: argparse.ArgumentParser, merged: dict[str, Setting], rank: dict[str, int],
                      defaults: Mapping[str, Setting]) -> None:
    """In a mutually exclusive group (run's --prompt / --tokens) the highest source wins; the rest fall back."""
    for group in parser._mutually_exclusive_groups:
        dests = [a.dest for a in group._group_actions if a.dest in merged and merged[a.dest].source != "default"]
        if len(dests) < 2:
            continue
        top = max(rank[d] for d in dests)
        winners = [d for d in dests if rank[d] == top]
        if len(winners) > 1:
            raise ColibriError(f"{merged[winners[0]].source}: {' and '.join(winners)} exclude each other; keep one")
        for dest in dests:
            if dest != winners[0]:
                merged[dest] = defaults[dest]


def configure(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None,
              command: str) -> Resolved:
    """Merge the settings of `command` into args and set the compute threads (app.cli calls it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parsers = command_parsers(parser)
    resolved = resolve(command, parsers, args, explicit_dests(parser, argv, parsers[command]))
    for notice in resolved.notices:
        print(f"colibri: {notice}", file=sys.stderr)
    for setting in resolved.settings.values():
        setattr(args, setting.key, setting.value)
    threads = resolved.settings.get("threads")
    if threads is not None:
        apply_threads(threads.value, threads.source)
    return resolved
