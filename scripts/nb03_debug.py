"""Run notebook 03's cells in a fresh kernel, print every iopub message with a timestamp; dump kernel stacks at 25 s."""
import sys, time
from jupyter_client.manager import start_new_kernel
import jupytext
nb = jupytext.read("notebooks/03_ddtree_visibility.py")
km, kc = start_new_kernel(kernel_name="python3", cwd="notebooks")
t0 = time.time()
cells = ["import faulthandler, sys; faulthandler.dump_traceback_later(25, exit=False, file=sys.__stderr__); print('armed')"]
cells += [c.source for c in nb.cells if c.cell_type == "code"]
for src in cells:
    msg_id = kc.execute(src)
    print(f"{time.time()-t0:7.2f} EXEC {src[:60]!r}", flush=True)
    done = False
    while not done and time.time() - t0 < 60:
        try:
            m = kc.get_iopub_msg(timeout=2)
        except Exception:
            print(f"{time.time()-t0:7.2f} (no iopub msg; alive={km.is_alive()})", flush=True); continue
        c = m["content"]
        short = {k: (str(v)[:200]) for k, v in c.items() if k not in ("data",)}
        if "data" in c: short["data_keys"] = list(c["data"])
        print(f"{time.time()-t0:7.2f} {m['msg_type']} {short}", flush=True)
        if m["msg_type"] == "status" and c.get("execution_state") == "idle" and m["parent_header"].get("msg_id") == msg_id:
            done = True
    if not done:
        print("STUCK; alive:", km.is_alive(), flush=True); break
km.shutdown_kernel(now=True)

# ---- the same notebook through nbclient (as tests/test_notebooks.py runs it), every message logged ----
import faulthandler
import nbformat
from nbclient import NotebookClient

faulthandler.dump_traceback_later(70, exit=False)  # this process too, if nbclient itself hangs
nb = nbformat.read("notebooks/03_ddtree_visibility.ipynb", as_version=4)
nb.cells.insert(0, nbformat.v4.new_code_cell("import faulthandler, sys; faulthandler.dump_traceback_later(25, exit=False, file=sys.__stderr__)"))
client = NotebookClient(nb, timeout=40, interrupt_on_timeout=True, allow_errors=True, kernel_name="python3",
                        resources={"metadata": {"path": "notebooks"}})
t1 = time.time()
orig = client.process_message


def logged(msg, cell, cell_index):
    c = msg["content"]
    print(f"NB {time.time()-t1:7.2f} cell {cell_index} {msg['msg_type']} {str({k: v for k, v in c.items() if k != 'data'})[:160]}", flush=True)
    return orig(msg, cell, cell_index)


client.process_message = logged
orig_comm = client.handle_comm_msg


def logged_comm(outs, msg, cell_index):
    print(f"NB {time.time()-t1:7.2f} comm handler {msg['msg_type']} {str(msg['content'].get('data', {}).get('state', {}))[:120]}", flush=True)
    return orig_comm(outs, msg, cell_index)


client.handle_comm_msg = logged_comm
try:
    client.execute()
    print("NB done", time.time() - t1, flush=True)
except Exception as e:  # noqa: BLE001
    print("NB failed:", type(e).__name__, e, flush=True)
for c in nb.cells:
    for o in c.get("outputs", []):
        if o.output_type == "error":
            print("ERROR OUTPUT", o.ename, o.evalue, "\n".join(o.traceback[-5:]))
