"""Widgets for the notebooks: they only wire controls to the pure figure functions in kdtree.plots.

Each explorer keeps its selection and a count of renders in `.state`, so a test (or a curious user) can
read back what the kernel side last drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ipywidgets as W
from IPython.display import Image, display

from kdtree import plots
from kdtree.capture import Capture, capture_files, load
from kdtree.validate import tree_block_problem

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "captured_batches"


class CapturePicker:
    """Pick the notebook's captures: a shipped one from the list, or any file or directory of yours typed in
    the path box (it wins when filled). Re-run the cells below after changing it."""

    def __init__(self, default: str | None = None, *, directory: Path = SHIPPED):
        shipped = sorted(directory.glob("*.safetensors"))
        self.shipped = {p.name: p for p in shipped}
        self.dropdown = W.Dropdown(
            options=list(self.shipped), value=default or (shipped[0].name if shipped else None), description="shipped"
        )
        self.path = W.Text(placeholder="or a capture file or directory of yours", description="path", layout={"width": "60%"})
        self.widget = W.VBox([self.dropdown, self.path])

    @property
    def paths(self) -> list[Path]:
        """The captures picked (several when the path names a directory)."""
        if self.path.value.strip():
            return capture_files(self.path.value.strip())
        return [self.shipped[self.dropdown.value]]

    def load(self) -> Capture:
        """The first capture picked, validated."""
        return load(self.paths[0])


@dataclass
class ExplorerState:
    capture: str = ""
    request: int = 0
    node: int = 0
    view: str = "draft block"
    renders: int = 0
    checks: list[str] = field(default_factory=list)
    note: str = ""  # e.g. the node slider clamped to a smaller tree


def request_checks(cap: Capture) -> list[str]:
    """The loader's tree checks, one line per request."""
    out = []
    for b in range(cap.batch_size):
        problem = tree_block_problem(cap.tree_block(b))
        out.append(
            f"request {b}: prefix {int(cap.prefix_lens[b])}, N {int(cap.num_draft[b])}: " + (problem or "well-formed tree")
        )
    return out


class DDTreeExplorer:
    """Capture, request, view (whole mask or draft block), zoom and node; draws the mask and the tree. The `add`
    box takes a capture file or directory of the user's."""

    def __init__(self, paths: list[Path]):
        self.paths = {Path(p).name: Path(p) for p in paths}
        self.state = ExplorerState()
        self._cap: Capture | None = None
        self.capture = W.Dropdown(options=list(self.paths), description="capture")
        self.request = W.IntSlider(description="request", min=0, max=0)
        self.view = W.ToggleButtons(options=["draft block", "whole mask"], description="view")
        self.zoom = W.FloatSlider(
            description="zoom",
            min=1.0,
            max=64.0,
            value=1.0,
            step=1.0,
            tooltip="whole mask: the last 1/zoom of the columns (the draft end); draft block: N/zoom nodes around the selected one",
        )
        self.node = W.IntSlider(description="node", min=0, max=0)
        self.add = W.Text(
            placeholder="add a capture file or directory of yours (Enter)",
            description="add",
            continuous_update=False,  # the value changes on Enter or leaving the box
            layout={"width": "60%"},
        )
        self.message = W.HTML()
        self.out = W.Output()
        self.capture.observe(self._on_capture, names="value")
        self.add.observe(lambda change: change["new"].strip() and self.add_captures(change["new"]), names="value")
        for w in (self.request, self.view, self.zoom, self.node):
            w.observe(lambda _change: self.render(), names="value")
        self.widget = W.VBox(
            [
                W.HBox([self.capture, self.request]),
                W.HBox([self.view, self.zoom]),
                self.node,
                W.HBox([self.add, self.message]),
                self.out,
            ]
        )
        self._on_capture(None)

    def add_captures(self, where: str) -> list[str]:
        """Add a capture file, or a directory's captures, to the dropdown and show the first; the names added.
        A path that holds none is said beside the box, not raised."""
        try:
            found = capture_files(where.strip())
        except ValueError as e:
            self.message.value = f"<span style='color:#c0392b'>{e}</span>"
            return []
        new = {}
        for p in found:
            name = p.name if p.name not in self.paths or self.paths[p.name] == p else str(p)
            new[name] = p
        self.paths.update(new)
        self.capture.options = list(self.paths)
        self.capture.value = next(iter(new))
        self.message.value = f"added {len(new)} capture(s)"
        return list(new)

    def _on_capture(self, _change) -> None:
        self._cap = load(self.paths[self.capture.value])
        with self.request.hold_trait_notifications():
            self.request.max = self._cap.batch_size - 1
            self.request.value = min(self.request.value, self.request.max)
        self.state.checks = request_checks(self._cap)
        self.render()

    def render(self) -> None:
        cap, b = self._cap, self.request.value
        n = int(cap.num_draft[b])
        note = ""
        if self.node.max != n - 1:
            wanted = self.node.value
            with self.node.hold_trait_notifications():
                self.node.max = n - 1
                self.node.value = min(self.node.value, n - 1)
            if self.node.value != wanted:
                note = f"node {wanted} is past this request's N = {n}: showing node {self.node.value}"
        node, p = self.node.value, int(cap.prefix_lens[b])
        if self.view.value == "draft block":
            rows = cap.tree_block(b).numpy()
            # zoom: a window of N / zoom nodes around the selected one, in both directions
            w = min(n, max(2, -(-n // int(self.zoom.value))))
            lo = min(max(0, node - w // 2), n - w)
            hi = lo + w
            mask = plots.mask_figure(
                rows,
                p,
                first_col=p,
                selected=node,
                zoom=(lo, hi, p + lo, p + hi),
                title=f"request {b}: the draft block, columns prefix_len .. prefix_len + N - 1 of its mask rows",
            )
        else:
            rows = cap.mask_rows(b).numpy()
            width = rows.shape[1]
            c0 = int(width - width / self.zoom.value)
            mask = plots.mask_figure(
                rows, p, selected=node, zoom=(0, n, c0, width), title=f"request {b}: [N, prefix_len + N] mask"
            )
        tree = plots.tree_figure(
            cap.parents(b), selected=node, title=f"request {b}: node {node} at depth {int(cap.depths(b)[node])}"
        )
        self.state = ExplorerState(self.capture.value, b, node, self.view.value, self.state.renders + 1, self.state.checks, note)
        with self.out:
            self.out.clear_output(wait=True)
            display(Image(plots.to_png(mask)), Image(plots.to_png(tree)))
            print("\n".join(([note] if note else []) + self.state.checks))
