"""The server check's report as text: one block per mode, the verdict last."""

from __future__ import annotations


def _fmt(x, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def mode_lines(m: dict) -> list[str]:
    scan = m.get("scan", {})
    stopped = m.get("stopped", {})
    lines = [
        f"{m['mode']}: {'PASS' if m['passed'] else 'FAIL'}  ({m['seconds']:.0f} s, ready after {_fmt(m.get('ready_after'), '.0f')} s)",
        f"  requests answered {m['answered']}/{m['requests']}, {m['completion_tokens']} tokens in {m['verify_steps']} verify steps "
        f"(accept length {_fmt(m.get('accept_length'), '.2f')}); OpenAI endpoints: "
        + (", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in m.get("openai", {}).items()) or "-"),
    ]
    if scan.get("shadow_lines"):
        lines.append(
            f"  shadow lines {scan['shadow_lines']} (layers {scan['shadow_layers']}, TP ranks {scan.get('shadow_ranks', [0])}), "
            f"worst rel {_fmt(scan['worst_rel'])}, "
            f"non-finite {scan['nonfinite']}"
        )
    if scan.get("graph_batch_sizes"):
        lines.append(
            f"  target-verify CUDA graphs bs={scan['graph_batch_sizes']}; kdtree served: {scan.get('kdtree_served')}, "
            f"its graphs replayed: {scan.get('kdtree_graph_replayed')}"
        )
    if scan.get("selfcheck"):
        lines.append(f"  {scan['selfcheck']}")
    caps = m.get("captures") or []
    if caps:
        valid = sum(bool(c.get("valid")) for c in caps)
        clean = sum(bool(c.get("passed_vs_capture") and c.get("passed_vs_oracle")) for c in caps)
        worst = max((c.get("rel_vs_oracle") or 0.0 for c in caps), default=None)
        branch = max((c.get("max_branching") or 0 for c in caps), default=0)
        lines.append(
            f"  captures {len(caps)}: {valid} validate, {clean} diff clean ({caps[0].get('impl')} vs capture and oracle; "
            f"worst rel vs oracle {_fmt(worst)}), most children of a node {branch}"
        )
    if scan.get("errors"):
        lines.append(f"  errors in the server log: {len(scan['errors'])} (first: {scan['errors'][0]})")
    for line in scan.get("capture_budget_stops", []):
        lines.append(f"  [kdtree] {line}")
    for line in scan.get("fallbacks", []):
        lines.append(f"  fallback: [kdtree] {line}")
    if stopped:
        lines.append(
            f"  stopped: exit {stopped.get('exit_code')}, SIGKILL needed {stopped.get('sigkill')}, "
            f"processes left {stopped.get('group_left')}, port free {stopped.get('port_free')}"
        )
    lines += [f"  why: {r}" for r in m.get("reasons", [])]
    lines.append(f"  log: {m['log']}")
    return lines


def format_report(report: dict) -> str:
    env = report.get("environment", {})
    sk = report.get("sgl_kernel", {})
    spec = report["spec"]
    head = [
        f"kdtree server-check on {env.get('gpu')} (torch {env.get('torch')}, SGLang {env.get('sglang')}); "
        f"sgl_kernel: {sk.get('route')}{' ' + str(sk.get('version')) if sk.get('version') else ''}",
        f"model: {spec['heads_per_rank']} heads per rank (TP {spec['tp']}), {spec['layers']} layers, "
        f"hidden {spec['hidden_size']}, context {spec['context_length']} ({report.get('model_dir')})",
    ]
    body = [line for m in report["modes"].values() for line in mode_lines(m)]
    verdict = "PASS" if report["passed"] else ("FAIL" if report.get("complete") else "INCOMPLETE")
    n = len(report["modes"])
    tail = [f"{verdict}: {sum(m['passed'] for m in report['modes'].values())} of {n} mode(s) passed in {report['seconds']:.0f} s"]
    return "\n".join(head + body + tail)
