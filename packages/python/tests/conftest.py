import pytest

from idem import Idem, ManualClock, SqliteStore

# 2026-01-01T00:00:00Z: every test's clock starts here.
T0 = 1767225600000


class Env:
    def __init__(self, tmp_path, results=None):
        self.path = str(tmp_path / "idem.db")
        self.store = SqliteStore(self.path)
        self.clock = ManualClock(T0)
        self.idem = Idem(self.store, clock=self.clock, results=results)


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


@pytest.fixture
def make_env(tmp_path):
    return lambda **kw: Env(tmp_path, **kw)
