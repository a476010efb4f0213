"""What a ``jobs.train`` run prints about its compression policy: at the start, the link the
policy plans for; at the end, what it chose and why.

The adaptive policy (the default) prices every candidate plan with a cost model of the link
(``docs/cost-model.md``). With ``compression.adaptive.bandwidth`` set it plans for that rate
instead of measuring the link it runs on: on one machine's loopback the link is fast and
the policy would rightly stay dense, so the main job plans for a 100 Mbit/s link. These lines
say which, so that a compressed run on loopback is not read as a measurement of this machine.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

#: what each of the adaptive chooser's rules means, as a plan switch's cause
RULES = {
    "adaptive.first": "a first decision, or the first after a round cost was measured (no hysteresis)",
    "adaptive.floors": "a layer's floor moved (critical regime, or compression error above max_error)",
    "adaptive.switch": "the plan in force left the 10% band of the fastest for 2 boundaries",
    "guard.fallback": "the guard's fallback to dense",
}
SHOWN_SWITCHES = 8  # plan switches listed one per line; more are elided in the middle


def link(bandwidth: float) -> str:
    """``bandwidth`` (bytes/s per rank) as a link rate: "100 Mbit/s (12.5 MB/s per rank)"."""
    mbit = bandwidth * 8 / 1e6
    rate = f"{mbit / 1000:.3g} Gbit/s" if mbit >= 1000 else f"{mbit:.3g} Mbit/s"
    return f"{rate} ({bandwidth / 1e6:.3g} MB/s per rank)"


def intro(config: Any) -> list[str]:
    """The lines printed before training: the policy, and for ``adaptive`` the link it prices."""
    policy = config.compression.policy
    if policy != "adaptive":
        return [f"policy {policy}: it does not price the link (the adaptive default does)"]
    bandwidth = config.compression.adaptive.bandwidth
    if bandwidth is None:
        return ["policy adaptive: measures the link it runs on and compresses only where that saves time "
                "(on one machine's loopback: expect dense; compression.adaptive.bandwidth=BYTES_PER_S plans "
                "for a slower link)"]
    return [f"policy adaptive: plans for a {link(bandwidth)} link (compression.adaptive.bandwidth)",
            "  a planning figure, not a measurement of this machine's link: every candidate plan is priced at it "
            "(on one machine's loopback the link is fast, and the policy would rightly stay dense)"]


def spec_label(spec: dict[str, Any]) -> str:
    """A plan's compressor as the adaptive policy's reasons write it: "powersgd r=1", "topk 0.01"."""
    params = {k: v for k, v in spec.items() if k != "name"}
    if spec["name"] == "powersgd" and "rank" in params:
        return f"powersgd r={params['rank']}"
    if spec["name"] == "topk" and "ratio" in params:
        return f"topk {params['ratio']:g}"
    return " ".join([spec["name"], *(f"{k}={v}" for k, v in sorted(params.items()))])


def chosen(plan: dict[str, Any] | None) -> str:
    """The plan's compressors, most layers first: "powersgd r=1 on 2 layers, int4 on 1"."""
    if not plan:
        return "no plan reported"
    if plan.get("dense"):
        return "dense (the guard's fallback)"
    counts = Counter(spec_label(spec) for spec in plan.get("layers", {}).values() if spec.get("name") != "none")
    default = plan.get("default", {"name": "none"})
    local = plan.get("local")
    steps = f"; local steps, H={local['sync_every']}" if local else ""
    if not counts:
        return ("dense" if default.get("name") == "none" else f"{spec_label(default)} on every layer") + steps
    rest = "the rest dense" if default.get("name") == "none" else f"the rest {spec_label(default)}"
    groups = [f"{label} on {n} layer{'s' if n != 1 else ''}" for label, n in counts.most_common()]
    return f"{', '.join(groups)}, {rest}{steps}"


def switches(policy: dict[str, Any]) -> list[str]:
    """One line per plan switch the controller recorded (step, rule, reason), the middle elided."""
    events = [e for e in policy.get("events", []) if e.get("kind") == "plan"]
    lines = [f"    step {e['step']:>5} [{(e.get('why') or {}).get('rule', '?')}] {e['reason']}" for e in events]
    if len(lines) > SHOWN_SWITCHES:
        half = SHOWN_SWITCHES // 2
        lines = [*lines[:half], f"    ... {len(lines) - 2 * half} more ...", *lines[-half:]]
    return lines


def outcome(summary: dict[str, Any]) -> list[str]:
    """The lines printed after training: the link planned for, the plan chosen, why, the bytes."""
    policy = summary.get("policy", {})
    name = policy.get("name", "?")
    details = policy.get("policy_details") or {}
    head = f"policy {name}"
    if name == "adaptive" and details.get("bandwidth_bytes_per_s"):
        rate = link(details["bandwidth_bytes_per_s"])
        head += (f", planned for a {rate} link (a planning figure, not this machine's link)"
                 if details.get("bandwidth_assumed") else f", link measured at {rate}")
    plan = summary.get("final_plan")
    lines = [head, f"  chose at the end: {chosen(plan)} (plan v{plan['version'] if plan else '?'})"]
    if plan and plan.get("reason"):
        lines.append(f"  why: {plan['reason']}")
    latest = (details.get("history") or [None])[-1]  # [step, choice, reason]: the plan may be an older one, kept
    if latest and plan and latest[2] != plan.get("reason"):
        lines.append(f"  latest decision (step {latest[0]}): {latest[2]}")
    by_rule = policy.get("plan_switches_by_rule") or {}
    if by_rule:
        rules = "; ".join(f"{rule} {n}" + (f" ({RULES[rule]})" if rule in RULES else "")
                          for rule, n in sorted(by_rule.items(), key=lambda kv: -kv[1]))
        lines.append(f"  plan switches by rule: {rules}")
        lines += switches(policy)
    wire, dense = summary.get("wire_bytes_total") or 0.0, summary.get("dense_bytes_total") or 0.0
    if wire:
        lines.append(f"  bytes: {wire / 1e6:.4g} MB on the wire against {dense / 1e6:.4g} MB dense "
                     f"(all ranks, the whole run): {dense / wire:.1f}x fewer")
    return lines


__all__ = ["RULES", "chosen", "intro", "link", "outcome", "spec_label", "switches"]
