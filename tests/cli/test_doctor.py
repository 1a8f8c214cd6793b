"""`colibri doctor`: every check runs and reports a verdict; the parsers and verdicts on hand-made inputs."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from app import doctor
from app.doctor import CHECK_NAMES, VERDICTS, Check


def _parser() -> argparse.ArgumentParser:
    from app.commands import doctor as command

    parser = argparse.ArgumentParser(prog="colibri")
    command.register(parser.add_subparsers())
    return parser


def _assert_report(checks: list[dict]) -> None:
    assert [c["name"] for c in checks] == list(CHECK_NAMES)
    for c in checks:
        assert c["verdict"] in VERDICTS, c
        assert c["value"], c
        assert (c["fix"] is None) == (c["verdict"] == "ok"), c   # every warning and failure says what to do


def test_run_checks_covers_every_check(tmp_path: Path) -> None:
    checks = doctor.run_checks(models=tmp_path)
    _assert_report([c.as_dict() for c in checks])
    assert list(tmp_path.iterdir()) == []                          # the scratch files are gone
    assert doctor.exit_code(checks) == (1 if any(c.verdict == "fail" for c in checks) else 0)


def test_command_prints_json_and_text(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path))
    args = _parser().parse_args(["doctor", "--json"])
    code = args.func(args)
    checks = json.loads(capsys.readouterr().out)
    _assert_report(checks)
    assert code == (1 if any(c["verdict"] == "fail" for c in checks) else 0)

    args = _parser().parse_args(["doctor"])
    assert args.func(args) in (0, 1)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == len(CHECK_NAMES)
    columns = set()
    for line, name in zip(lines, CHECK_NAMES, strict=True):
        assert line.split("]", 1)[1].strip().startswith(name)
        columns.add(line.index(name))
    assert len(columns) == 1                                         # the names line up in one column


def test_unexpected_error_becomes_a_warning() -> None:
    def broken() -> Check:
        raise KeyError("MemTotal")

    c = doctor._guarded("memory", broken)
    assert c.verdict == "warn" and "KeyError" in c.value and "MemTotal" in c.value and c.fix


MEMINFO = """\
MemTotal:       16384000 kB
MemFree:         1024000 kB
MemAvailable:    8192000 kB
Buffers:           98016 kB
SwapTotal:       4096000 kB
SwapFree:        1024000 kB
HugePages_Total:       0
"""


def test_parse_meminfo_gives_bytes() -> None:
    m = doctor.parse_meminfo(MEMINFO)
    assert m["MemTotal"] == 16384000 * 1024
    assert m["MemAvailable"] == 8192000 * 1024
    assert m["HugePages_Total"] == 0                # counts without a unit stay as they are


def test_memory_verdicts() -> None:
    m = doctor.parse_meminfo(MEMINFO)
    ok = doctor.check_memory(m, limit=None)
    assert ok.verdict == "ok" and "16.78 GB total" in ok.value and "--max-memory 6.71GB" in ok.value
    limited = doctor.check_memory(m, limit=4 * 10**9)
    assert "container limit 4.00 GB" in limited.value and "--max-memory 3.20GB" in limited.value
    low = doctor.check_memory(m | {"MemAvailable": 500 * 10**6}, limit=None)
    assert low.verdict == "warn" and "close programs" in low.fix


def test_swap_and_swappiness_verdicts() -> None:
    swapping = doctor.check_swap(doctor.parse_meminfo(MEMINFO))   # 3 of 4 GB used
    assert swapping.verdict == "warn" and "--max-memory" in swapping.fix
    assert doctor.check_swap({"SwapTotal": 0, "SwapFree": 0}).verdict == "ok"
    assert doctor.check_swappiness("60\n", zram_only=False).verdict == "ok"
    high = doctor.check_swappiness("100\n", zram_only=False)
    assert high.verdict == "warn" and "sysctl vm.swappiness=10" in high.fix
    assert doctor.check_swappiness("180", zram_only=True).verdict == "ok"    # zram wants it high


CPUINFO_X86 = """\
processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx fma avx2 avx512f avx512bw amx_bf16 amx_tile amx_int8

processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx fma avx2 avx512f avx512bw amx_bf16 amx_tile amx_int8
"""

CPUINFO_OLD_X86 = """\
processor	: 0
model name	: Intel(R) Core(TM)2 Duo CPU E8400
flags		: fpu sse sse2 ssse3 sse4_1
"""

CPUINFO_ARM = """\
processor	: 0
BogoMIPS	: 50.00
Features	: fp asimd evtstrm aes crc32 atomics
CPU implementer	: 0x41
"""


def test_parse_cpuinfo_and_features() -> None:
    info = doctor.parse_cpuinfo(CPUINFO_X86)
    assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert doctor.cpu_features(info.flags) == {"AVX2": True, "AVX-512": True, "AMX": True}
    old = doctor.parse_cpuinfo(CPUINFO_OLD_X86)
    assert doctor.cpu_features(old.flags) == {"AVX2": False, "AVX-512": False, "AMX": False}
    assert "asimd" in doctor.parse_cpuinfo(CPUINFO_ARM).flags


def test_cpu_verdicts() -> None:
    good = doctor.check_cpu(doctor.parse_cpuinfo(CPUINFO_X86), cpu_name="host")
    assert good.verdict == "ok" and "AVX2 yes, AVX-512 yes, AMX yes" in good.value
    old = doctor.check_cpu(doctor.parse_cpuinfo(CPUINFO_OLD_X86), cpu_name="host")
    assert old.verdict == "warn" and "AVX2" in old.fix
    generic = doctor.check_cpu(doctor.parse_cpuinfo(CPUINFO_X86), cpu_name="generic")
    assert generic.verdict == "warn" and "NUMBA_CPU_NAME" in generic.fix
    arm = doctor.check_cpu(doctor.parse_cpuinfo(CPUINFO_ARM), cpu_name="host")
    assert arm.verdict == "ok" and "AVX2" not in arm.value          # x86 features are not asked of an ARM CPU


def test_missing_display_warns_and_points_at_chat() -> None:
    c = doctor.check_display({})
    assert c.verdict == "warn" and "`colibri chat`" in c.fix
    assert doctor.check_display({"DISPLAY": ":0"}).verdict == "ok"
    offscreen = doctor.check_display({"QT_QPA_PLATFORM": "offscreen"})
    assert offscreen.verdict == "warn" and "colibri chat" in offscreen.fix


def test_gui_probe_without_display_still_checks_qt() -> None:
    probe = doctor.gui_probe({k: v for k, v in os.environ.items()
                              if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")})
    assert probe["gl"] is False                         # no display: no OpenGL context is tried
    assert doctor.check_qt(probe).verdict in VERDICTS
    assert doctor.check_opengl(probe).name == "OpenGL"


def test_qt_and_opengl_verdicts_from_probe_results() -> None:
    assert doctor.check_qt({"crash": "exit -6: could not connect to display", "gl": True}).verdict == "warn"
    assert "LIBGL_ALWAYS_SOFTWARE" in doctor.check_qt({"timeout": 20.0, "gl": True}).fix
    missing = doctor.check_qt({"error": "ModuleNotFoundError: No module named 'PySide6'", "gl": True})
    assert missing.verdict == "warn" and "PySide6-Essentials" in missing.fix
    gl = doctor.check_opengl({"gl": True, "context": True, "renderer": "llvmpipe (LLVM 15)", "version": "4.5 Mesa"})
    assert gl.verdict == "ok" and "software" in gl.value
    assert doctor.check_opengl({"gl": True, "context": False}).verdict == "warn"


def test_direct_io_check_on_a_folder(tmp_path: Path) -> None:
    assert isinstance(doctor.direct_io_works(tmp_path), bool)
    assert list(tmp_path.iterdir()) == []


def test_disk_read_is_measured(tmp_path: Path) -> None:
    gbs = doctor.measure_disk_read(tmp_path, 8 << 20)
    assert gbs > 0
    assert list(tmp_path.iterdir()) == []


def test_mounts_parse_and_the_longest_mount_point_wins(tmp_path: Path) -> None:
    text = ("/dev/vda / ext4 rw 0 0\n"
            "tmpfs /dev/shm tmpfs rw 0 0\n"
            f"/dev/sdb1 {str(tmp_path).replace(' ', chr(92) + '040')} xfs rw 0 0\n")
    mounts = doctor.parse_mounts(text)
    assert mounts[2].point == str(tmp_path)
    assert doctor.mount_of(tmp_path, mounts).fstype == "xfs"
    assert doctor.mount_of(Path("/dev/shm"), mounts).fstype == "tmpfs"
    spaced = doctor.parse_mounts("/dev/sdc1 /media/my\\040disk vfat rw 0 0\n")
    assert spaced[0].point == "/media/my disk"


def test_models_folder_verdicts(tmp_path: Path, monkeypatch) -> None:
    def info(fstype: str, free: int):
        return lambda folder: doctor.DiskInfo(folder, fstype, "sda", False, free)

    monkeypatch.setattr(doctor, "disk_info", info("ext4", 100 * 10**9))
    assert doctor.check_models_folder(tmp_path).verdict == "ok"
    monkeypatch.setattr(doctor, "disk_info", info("nfs4", 100 * 10**9))
    assert "COLIBRI_MODELS_DIR" in doctor.check_models_folder(tmp_path).fix
    monkeypatch.setattr(doctor, "disk_info", info("ext4", 5 * 10**8))
    assert doctor.check_models_folder(tmp_path).verdict == "fail"


def test_check_refuses_an_unknown_verdict() -> None:
    with pytest.raises(ValueError, match="verdict"):
        Check("x", "y", "maybe")
