"""The live inspector of the desktop app: Overview, Time, Brain and Atlas views of a generation.

`Inspector` is the widget the main window embeds; `tiers_from_store` and `resident_tiers` make
the per-expert tier grid it takes (`Inspector.set_tiers`).
"""

from ui.inspector.data import (
    TIER_CACHED,
    TIER_DISK,
    TIER_NONE,
    TIER_PINNED,
    TIER_RESIDENT,
    resident_tiers,
    tiers_from_store,
)
from ui.inspector.inspector import Inspector

__all__ = ["Inspector", "tiers_from_store", "resident_tiers", "TIER_NONE", "TIER_DISK", "TIER_CACHED",
           "TIER_PINNED", "TIER_RESIDENT"]
