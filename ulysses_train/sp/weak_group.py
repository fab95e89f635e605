"""A process group held weakly, for every object of ours that keeps one (the SP groups, the attention registered
with transformers, the ring, the all-to-all's autograd context)."""

from __future__ import annotations

import weakref


class WeakGroup:
    """A process group held weakly: torch's registry keeps it alive until `destroy_process_group()`, and nothing of
    ours may keep it longer. A gloo group that outlives that call keeps its worker threads (and their work) into
    interpreter exit, where destroying it can abort the process (`terminate called without an active exception`,
    SIGABRT, exit -6). None stays None (no group)."""

    def __init__(self, group):
        self._ref = None if group is None else weakref.ref(group)

    def get(self):
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError("the process groups were destroyed (torch.distributed.destroy_process_group): build "
                               "the SP groups again after a new init_process_group")
        return group
