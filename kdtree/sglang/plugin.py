"""SGLang's plugin hook (entry point group `sglang.srt.plugins`, name `kdtree`): makes `--attention-backend
kdtree` a choice of SGLang's argument parser and registers the backend's factory. SGLang calls `register()` in
`launch_server`, in `Engine.__init__` and in every scheduler subprocess, so each process that builds an attention
backend has it. The backend module (which imports SGLang's Triton backend) loads only when one is built.
"""

from __future__ import annotations

NAME = "kdtree"


def create_backend(model_runner):
    """The factory SGLang calls as `ATTENTION_BACKENDS["kdtree"](model_runner)`."""
    from kdtree.sglang.backend import KdtreeAttnBackend

    return KdtreeAttnBackend(model_runner)


def register() -> None:
    """Add `kdtree` to the attention-backend choices and to the backend registry (idempotent)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    register_attention_backend(NAME)(create_backend)
