"""Fake ``pycuda`` (tests only): the driver API over the emulated GPU in ``_fake_gpu``."""

VERSION = (2025, 1, 2)
VERSION_TEXT = "2025.1.2+fake"
