"""kdtree: a workbench for tree-verify MLA attention kernels (SGLang TARGET_VERIFY, DDTree/EAGLE)."""

__version__ = "0.1.0"

from kdtree.capture import Capture, CaptureError, CaptureMeta, load, save  # noqa: E402

__all__ = ["Capture", "CaptureError", "CaptureMeta", "load", "save", "__version__"]
