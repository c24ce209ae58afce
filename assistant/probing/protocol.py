"""The runner <-> probe protocol, as the assistant sees it: probes/probe_protocol.py itself.

The canonical file lives in probes/ because the probes must stay copyable
to any node without this package. Rather than keep a second copy here, this
module loads that file (the one shipped with this package: the checkout's
probes/, or the wheel's share/ddp-assistant/probes/) and exposes its names:

    from assistant.probing.protocol import FACTS_DIR_ENV, DevicesFacts, variant_outcomes

The file is registered as the module `probe_protocol`, the name the probe
scripts import it by, so a probe module imported into this process (tests
do) shares the very same classes. ASSISTANT_PROBES (a test copy of the
probes) does not move it: the protocol belongs to this package's version.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from assistant.config import resources_root

MODULE_NAME = "probe_protocol"


def protocol_path() -> Path:
    """The canonical protocol file."""
    return resources_root() / "probes" / f"{MODULE_NAME}.py"


def load_protocol() -> ModuleType:
    """probes/probe_protocol.py as a module, loaded once per process."""
    path = protocol_path()
    loaded = sys.modules.get(MODULE_NAME)
    if loaded is not None and Path(loaded.__file__).resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the probe protocol from {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses look their module up by name.
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


_PROTOCOL = load_protocol()

# The names the assistant uses, bound here so that readers and linters see them.
FORMAT: int = _PROTOCOL.FORMAT
FACTS_DIR_ENV: str = _PROTOCOL.FACTS_DIR_ENV
VARIANT_ENV: str = _PROTOCOL.VARIANT_ENV
RUNNER_ENV: str = _PROTOCOL.RUNNER_ENV
NPROC_SOURCE_ENV: str = _PROTOCOL.NPROC_SOURCE_ENV
USER_PREFIX: str = _PROTOCOL.USER_PREFIX
LAUNCHER_VARS: tuple[str, ...] = _PROTOCOL.LAUNCHER_VARS
LAUNCHER_PREFIXES: tuple[str, ...] = _PROTOCOL.LAUNCHER_PREFIXES
PROBE_ORDER: tuple[str, ...] = _PROTOCOL.PROBE_ORDER
BATCH_SCRIPT: str = _PROTOCOL.BATCH_SCRIPT
SET_DEVICE_VARIANTS: tuple[str, ...] = _PROTOCOL.SET_DEVICE_VARIANTS
PROBE_VARIANTS: dict[str, tuple[str, ...]] = _PROTOCOL.PROBE_VARIANTS
FINAL_STATUSES: tuple[str, ...] = _PROTOCOL.FINAL_STATUSES
record_filename = _PROTOCOL.record_filename
is_record_filename = _PROTOCOL.is_record_filename
new_record = _PROTOCOL.new_record
physical_gpu_count = _PROTOCOL.physical_gpu_count
visible_gpu_count = _PROTOCOL.visible_gpu_count
Facts = _PROTOCOL.Facts
RankRecord = _PROTOCOL.RankRecord
FACTS_TYPES = _PROTOCOL.FACTS_TYPES
VariantOutcome = _PROTOCOL.VariantOutcome
variant_outcomes = _PROTOCOL.variant_outcomes


def __getattr__(name: str):
    """Every other public name of the protocol (DevicesFacts, BackendFacts, ...)."""
    if not name.startswith("_") and hasattr(_PROTOCOL, name):
        return getattr(_PROTOCOL, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {n for n in vars(_PROTOCOL) if not n.startswith("_")})
