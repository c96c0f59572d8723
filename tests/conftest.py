"""Session fixtures shared by every test: throwaway servers live in tests/servers/."""

from __future__ import annotations
