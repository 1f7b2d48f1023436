"""A pytest plugin that lets LMCache's storage-manager tests run on a host without a GPU.

`tests/v1/distributed/test_distributed_storage_manager.py` skips itself unless LMCache's device
reports itself available, and on a CPU-only host LMCache picks its CPU stub device, which never
does. Its storage manager, L1 memory and controllers run on the CPU all the same (LMCache's own
mock adapter passes every test there, the control run): this plugin has the stub say so.
"""

from __future__ import annotations

from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

StubCPUDevice.is_available = lambda self: True  # type: ignore[method-assign]
