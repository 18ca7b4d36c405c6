"""`make lab`: JupyterLab over the whole repository - `notebooks/`, `kernels/` (the `.cu` the kernel notebook asks
you to edit) and `data/` - opening on `notebooks/`.

The notebooks are tracked as py:percent scripts only (jupytext). Their `.ipynb` working copies are made here when
missing and are ignored by git, so running and saving in the Lab never writes outputs into a tracked file; an edit
to a cell's code reaches the paired script on save, as it should (`jupytext.toml` keeps the scripts' header free
of version stamps, so saving does not rewrite it).

Usage: python -m kdtree.lab [--ip 127.0.0.1] [--port 8888] [--no-browser]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def ensure_notebooks(root: Path = ROOT) -> list[Path]:
    """The `.ipynb` of every `notebooks/*.py` script that has none yet, made from the script; the ones made."""
    import jupytext

    made = []
    for script in sorted((root / "notebooks").glob("*.py")):
        nb = script.with_suffix(".ipynb")
        if not nb.exists():
            notebook = jupytext.read(script)
            notebook.metadata["kernelspec"] = KERNELSPEC  # the .ipynb's alone: scripts carry no kernel
            jupytext.write(notebook, nb)
            made.append(nb)
    return made


def command(root: Path, ip: str, port: int, *, browser: bool = True, extra: list[str] | None = None) -> list[str]:
    """The JupyterLab command line: the repository as the server's root, opening on notebooks/."""
    cmd = [
        sys.executable, "-m", "jupyterlab",
        f"--ip={ip}",
        f"--port={port}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.default_url=/lab/tree/notebooks",
        "--LabApp.news_url=",
    ]  # fmt: skip
    if not browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # Jupyter refuses root unless told (containers often are root)
    return cmd + list(extra or [])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.lab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ip", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8888)
    ap.add_argument("--no-browser", action="store_true")
    args = ap.parse_args(argv)
    for nb in ensure_notebooks():
        print(f"made {nb.relative_to(ROOT)} from its script")
    print(
        f"JupyterLab on http://{args.ip}:{args.port}/lab - open the URL with the token that Jupyter prints below.\n"
        f"On a remote GPU machine: ssh -L {args.port}:localhost:{args.port} THAT-MACHINE, then open the URL here."
    )
    cmd = command(ROOT, args.ip, args.port, browser=not args.no_browser)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
