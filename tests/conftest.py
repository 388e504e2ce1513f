"""Test setup: the real-model factories in tests/models are importable as ``models``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
