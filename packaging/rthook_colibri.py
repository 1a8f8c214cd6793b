"""PyInstaller runtime hook of the packaged app: runs before the app's first import.

numba caches compiled kernels beside their source unless told otherwise; in the bundle that is
the install folder, often read-only and never the user's. Send the cache to the user's cache
folder (`~/.cache/colibri/numba` on Linux) unless NUMBA_CACHE_DIR is set already.
"""

import os

if not os.environ.get("NUMBA_CACHE_DIR"):
    import platformdirs

    os.environ["NUMBA_CACHE_DIR"] = os.path.join(platformdirs.user_cache_dir("colibri", appauthor=False), "numba")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as app.config.runtime.prepare_process, before OpenMP starts
