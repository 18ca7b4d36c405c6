from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kdtree.capture import FORMAT_VERSION, CaptureMeta, header_json
from kdtree.synth import SynthSpec, synthesize

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "data" / "captured_batches").glob("*.safetensors"))


def small(**kw):
    """A small synthetic capture (fast on CPU)."""
    base = dict(batch_size=3, prefix_lens=[0, 5, 40], budget=8, seed=11)
    base.update(kw)
    return synthesize(SynthSpec(**base))


def write_raw(path: Path, tensors: dict[str, torch.Tensor], meta: CaptureMeta, version: int = FORMAT_VERSION) -> Path:
    """Write a capture file without any validation (to build broken ones)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"kdtree": header_json(meta, version)})
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny():
    return small()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (run `make test-gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
