"""Test hook (on PYTHONPATH): in rank 1 of a data-parallel server, reading the checkpoint takes
IRMINSUL_TEST_SLOW_LOAD_S longer, as a rank's share of a large checkpoint can (a slower disk, a
busier NUMA node, a bigger share)."""
import os
import sys

if os.environ.get("RANK") == "1" and os.environ.get("IRMINSUL_TEST_SLOW_LOAD_S"):
    import importlib.abc
    import importlib.machinery
    import time

    delay = float(os.environ["IRMINSUL_TEST_SLOW_LOAD_S"])

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner):  # noqa: ANN001
            self.inner = inner

        def create_module(self, spec):  # noqa: ANN001
            return self.inner.create_module(spec)

        def exec_module(self, module):  # noqa: ANN001
            self.inner.exec_module(module)
            original = module.load_shard

            def slow(*args, **kwargs):  # noqa: ANN002,ANN003
                time.sleep(delay)
                return original(*args, **kwargs)

            module.load_shard = slow

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # noqa: ANN001
            if name != "irminsul.parallel.load":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = _Loader(spec.loader)
            return spec

    sys.meta_path.insert(0, _Hook())

if os.environ.get("RANK") == "1" and os.environ.get("IRMINSUL_TEST_SLOW_START_S"):
    # Rank 1 reaches the group's rendezvous late (a cold start: Python, torch, CUDA's init).
    import time

    time.sleep(float(os.environ["IRMINSUL_TEST_SLOW_START_S"]))
