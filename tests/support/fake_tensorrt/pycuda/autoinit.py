"""Fake ``pycuda.autoinit``: initialise the driver and make a context on device 0 current."""

from __future__ import annotations

import atexit

from pycuda import driver

driver.init()
device = driver.Device(0)
context = device.make_context()
atexit.register(driver.Context.pop)
