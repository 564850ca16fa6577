"""The graphed step's post-grad FX passes, handed to Inductor as one ``CustomGraphPass``.

Inductor takes a single ``post_grad_custom_post_pass``; ours runs each pass in order. Its uuid
(part of Inductor's FX graph cache key) hashes the files the passes and their kernels live in, so
an edit to any of them recompiles.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def custom_pass(passes: Sequence[Callable[[torch.fx.Graph], object]], files: Sequence[str]) -> Optional[object]:
    """``passes`` (each takes the post-grad graph and edits it in place) as one Inductor
    ``CustomGraphPass``; None where this torch has no such class."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    except ImportError:
        return None

    class StepPasses(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for run in passes:
                run(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__, *files))

    return StepPasses()
