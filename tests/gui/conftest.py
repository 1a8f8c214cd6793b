"""Every test in this folder drives Qt widgets: they carry the `gui` marker (`make test-fast` leaves them out).
The inspector's tests share a shown Inspector."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the items collected from this folder (the hook sees the whole session's items)."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gui)


@pytest.fixture
def inspector(qtbot):
    """A shown Inspector of 900 x 600, closed (close_views first) at teardown."""
    from ui.inspector import Inspector

    insp = Inspector()
    qtbot.addWidget(insp, before_close_func=lambda w: w.close_views())
    insp.resize(900, 600)
    insp.show()
    qtbot.waitExposed(insp)
    return insp
