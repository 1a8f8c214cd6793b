#!/usr/bin/env bash
# Install the built bundle (dist/colibri) for the current user, so Colibri shows in the application menu.
#
#   packaging/install.sh [--uninstall] [--from DIST_FOLDER]
#
# Puts the app in $PREFIX/share/colibri/app, a `colibri` link in $PREFIX/bin, the icons in
# $PREFIX/share/icons/hicolor/<size>/apps and colibri.desktop in $PREFIX/share/applications.
# PREFIX defaults to ~/.local; DESTDIR is prepended to every path written (for staging).
# Models, settings and conversations live in the user's folders and are never touched here.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${PREFIX:-$HOME/.local}"
DESTDIR="${DESTDIR:-}"
FROM="$REPO/dist/colibri"
UNINSTALL=0
while [ $# -gt 0 ]; do
	case "$1" in
		--uninstall) UNINSTALL=1 ;;
		--from) FROM="$2"; shift ;;
		-h|--help) sed -n '2,9p' "$0"; exit 0 ;;
		*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
	shift
done

APP="$PREFIX/share/colibri/app"                 # where the app lives once installed (Exec points here)
ROOT="$DESTDIR$PREFIX"
ICONS="$ROOT/share/icons/hicolor"
ENTRY="$ROOT/share/applications/colibri.desktop"
SIZES="16 32 48 64 128 256"

refresh() {   # let the desktop see the change at once (the tools are optional)
	command -v update-desktop-database >/dev/null && update-desktop-database -q "$ROOT/share/applications" || true
	command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t "$ICONS" 2>/dev/null || true
}

if [ "$UNINSTALL" = 1 ]; then
	rm -rf "$DESTDIR$APP"
	rmdir "$DESTDIR$PREFIX/share/colibri" 2>/dev/null || true
	rm -f "$ENTRY" "$ROOT/bin/colibri" "$ICONS/scalable/apps/colibri.svg"
	for s in $SIZES; do rm -f "$ICONS/${s}x${s}/apps/colibri.png"; done
	refresh
	echo "install.sh: Colibri removed from $PREFIX (models, settings and conversations are kept)"
	exit 0
fi

if [ ! -x "$FROM/colibri" ]; then
	echo "install.sh: no built app in $FROM: run \`make package\` first (or pass --from DIST_FOLDER)" >&2
	exit 1
fi
rm -rf "$DESTDIR$APP.new"
mkdir -p "$(dirname "$DESTDIR$APP")" "$ROOT/bin" "$ROOT/share/applications" "$ICONS/scalable/apps"
cp -a "$FROM" "$DESTDIR$APP.new"                 # copy beside, then swap: a failed copy leaves the old app
rm -rf "$DESTDIR$APP"
mv "$DESTDIR$APP.new" "$DESTDIR$APP"
ln -sfn "$APP/colibri" "$ROOT/bin/colibri"
for s in $SIZES; do
	install -D -m 644 "$REPO/assets/icons/colibri-$s.png" "$ICONS/${s}x${s}/apps/colibri.png"
done
install -m 644 "$REPO/assets/icon.svg" "$ICONS/scalable/apps/colibri.svg"
# Exec and TryExec name the installed program by its full path: ~/.local/bin is not always on PATH.
sed -e "s|^Exec=colibri|Exec=$APP/colibri|" -e "s|^TryExec=colibri|TryExec=$APP/colibri|" \
	"$REPO/packaging/colibri.desktop" > "$ENTRY"
chmod 644 "$ENTRY"
refresh
echo "install.sh: Colibri installed in $APP; it is in the application menu (entry $ENTRY)"
