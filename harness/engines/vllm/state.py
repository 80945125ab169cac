"""What the plugin installed in this vLLM process: one record that the plugin writes and the routing
providers (:mod:`harness.engines.vllm.sere`, :mod:`harness.engines.vllm.topk`) read.

Why a module of its own: the plugin imports the providers to build them, and the providers need the
process's settings (``moe.top_k`` beside SERE, the settings their statistics report). Keeping that record
here, below both, means neither imports the other (it used to be the plugin's private ``_STATE``: an
import circle plugin → sere → plugin).
"""

from __future__ import annotations

import threading
from typing import Any

LOCK = threading.Lock()
#: ``registered``; ``sere`` / ``moe`` / ``visionzip`` (the settings dataclasses or None); ``routing`` (the
#: provider the MoE-constructor wrapper asks); ``sere_artifacts``; ``factory_patched`` (the name of the
#: wrapped constructor, or False); ``runner_patched``; ``visionzip_archs``.
STATE: dict[str, Any] = {"registered": False, "sere": None, "moe": None, "visionzip": None,
                         "factory_patched": False, "runner_patched": False}
