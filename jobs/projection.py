"""What would the adaptive policy choose, and gain, on a cluster this machine is not? A
projection on paper.

    python -m jobs.projection --config jobs/configs/gpt_kjv.yaml --workers 64 --link 25gbit \\
        --compute-ms 120 [--round-ms 1] [--decode-rate 3.4e7] [--lossy auto|always|never] [--intervals 30]

It runs the controller's own adaptive policy (the cost model, ladders and chooser the
controller runs) on a simulated run: the workload's layers at ``--workers`` ranks, a link
of ``--link`` per rank that the policy plans for (as ``compression.adaptive.bandwidth``),
a step that computes for ``--compute-ms``, an extra collective round that costs
``--round-ms``, and an all-gather's decode at ``--decode-rate`` bytes of payload per second
(as ``compression.adaptive.decode_rate``; by default Top-K's fastest decompress rate
of the sizes in ``docs/benchmarks/kernels.json``). Each control interval the simulated ranks run the
plan the controller published and report what real workers report, their communication
priced by the same traffic the cost model assumes (an all-gather receives W-1 payloads and
decodes W, the all-reduce-shaped transports send 2(W-1)/W); gradient norms stay constant,
so no layer stays in a critical regime, and every lossy rung's error is ``--error``. The
plan it settles on is printed with the predicted step of every candidate and the gain over
dense.

Where it stops being trustworthy: the traffic is exact for raycomp's transports, but the
link is one rate per rank with no contention, no latency growing with W (a ring's 2(W-1)
steps) and no topology; a round costs ``--round-ms`` whatever W; an all-gather's decode
grows as W payloads at one measured rate, on one CPU thread, whose per-payload rate
includes zeroing a dense tensor that a decode of W payloads zeroes once (pessimistic), and
nothing else of the codec (compressing, error feedback) is priced; compute does not shrink
with W (weak scaling); and the lossy rungs' error, which decides whether they are kept, is
an input, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.bench.netns.units import parse_rate
from raycomp.compressors import Transport, make_compressor
from raycomp.controllers.policies.cost_model import family_rounds
from raycomp.controllers.service import Controller
from raycomp.plan import Plan

MIN_COMPRESS_NUMEL = 1024
INTERVAL = 10
ROUND_MS = 1.0  # --round-ms's default: an extra collective round, until measured
KERNELS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "kernels.json"
#: bytes/s of Top-K payload decoded when ``KERNELS`` cannot be read: its 1,048,576-element
#: row (83,888 payload bytes decompressed in 0.73 ms, one thread)
DECODE_RATE_FALLBACK = 114.8e6


@dataclass(frozen=True)
class Setting:
    """The cluster to project onto."""

    workers: int
    bandwidth: float  # bytes/s per rank
    compute: float  # seconds a step computes
    round_seconds: float  # an extra collective round
    lossy: str = "always"  # "always" (as for SGD) or "never" (as for Adam)
    error: float = 0.5  # every lossy rung's measured relative error
    decode_rate: float | None = None  # bytes/s of all-gathered payload a rank decodes (None: free)


def default_decode_rate(path: Path = KERNELS) -> tuple[float, str]:
    """Top-K's measured decode rate, payload bytes over decompress seconds, the fastest of the
    kernel benchmark ``path``'s sizes, and where it came from. Each decompress there also
    zero-fills a dense tensor, which a decode of W payloads does once, not W times: the
    size where that fill weighs least is the closest to a payload's own decode (and still a
    pessimistic one);
    :data:`DECODE_RATE_FALLBACK` if the file is missing or holds no Top-K row."""
    try:
        rows = [r for r in json.loads(path.read_text()) if r.get("compressor") == "topk"
                and r.get("decompress_s", 0) > 0 and r.get("wire_bytes", 0) > 0]
    except (OSError, ValueError, AttributeError):
        rows = []
    if not rows:
        return DECODE_RATE_FALLBACK, f"{path.name} unreadable, the fallback constant"
    row = max(rows, key=lambda r: r["wire_bytes"] / r["decompress_s"])
    return row["wire_bytes"] / row["decompress_s"], f"topk at {row['numel']:,} elements in {path.name}"


def parse_decode_rate(text: str) -> float:
    """Bytes per second: a plain number (``3.4e7``), or a rate in tc's units (``30mbps`` is
    30 MB/s, ``240mbit`` the same)."""
    try:
        rate = float(text)
    except ValueError:
        try:
            rate = (parse_rate(text) or 0.0) / 8
        except ValueError:
            rate = math.nan
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"--decode-rate: bytes per second such as 3.4e7, or a rate such as 30mbps, got {text!r}")
    return rate


def layer_bytes(spec_name: str, params: dict[str, Any], numel: int, shape: tuple[int, ...], world: int) -> float:
    """One rank's bytes on the wire for one layer and step: what the compressor sends,
    times what its transport moves per payload byte at ``world`` ranks."""
    return layer_traffic(spec_name, params, numel, shape, world)[0]


def layer_traffic(spec_name: str, params: dict[str, Any], numel: int, shape: tuple[int, ...],
                  world: int) -> tuple[float, float]:
    """One rank's bytes on the wire for one layer and step (as :func:`layer_bytes`), and the
    bytes of payload it decodes: all ``world`` ranks' on an all-gather, none otherwise."""
    compressor = make_compressor(spec_name, **params)
    rows = shape[0] if len(shape) >= 2 else 1
    payload = compressor.payload_bytes(numel, (rows, numel // rows), 4.0)
    if compressor.transport is Transport.ALLGATHER:
        return (world - 1) * payload, world * payload
    return 2 * (world - 1) / world * payload, 0.0


def comm_seconds(setting: Setting, wire: float, decoded: float, kinds: set[str]) -> float:
    """One rank's communication a step: ``wire`` bytes over the link, ``decoded`` bytes of
    all-gathered payload at the decode rate, and the extra rounds of the compressors ``kinds``."""
    decode = decoded / setting.decode_rate if setting.decode_rate else 0.0
    rounds = family_rounds(kinds, setting.workers)
    return wire / setting.bandwidth + decode + sum(rounds.values()) * setting.round_seconds


def project(shapes: dict[str, tuple[int, ...]], setting: Setting, intervals: int = 30) -> dict[str, Any]:
    """The adaptive policy's settled plan for ``shapes`` on ``setting``, its predicted step and
    dense's, after ``intervals`` simulated control intervals."""
    w = setting.workers
    options = {"bandwidth": setting.bandwidth, "round_seconds": setting.round_seconds, "warmup": "dense",
               "lossy": setting.lossy, "decode_rate": setting.decode_rate}
    controller = Controller()
    controller.register_run("projection", w, {n: list(s) for n, s in shapes.items()}, "adaptive", options, 0, INTERVAL,
                            MIN_COMPRESS_NUMEL)
    step, wire_total, dense_total = -1, 0.0, 0.0
    dense_step = sum(layer_bytes("none", {}, math.prod(s), s, w) for s in shapes.values())
    for _ in range(intervals):
        plan: Plan = controller.runs["projection"].plan
        step += INTERVAL
        layers, wire, decoded, kinds = [], 0.0, 0.0, set()
        for name, shape in shapes.items():
            n, spec = math.prod(shape), plan.spec_for(name)
            kind = spec.name if n >= MIN_COMPRESS_NUMEL and not spec.is_dense else "none"
            params = dict(spec.params) if kind != "none" else {}
            sent, decodes = layer_traffic(kind, params, n, shape, w)
            kinds.add(kind)
            wire += sent
            decoded += decodes
            lossy = kind in ("powersgd", "topk", "dgc", "sign")
            layers.append({"layer": name, "compressor": kind, "numel": n, "grad_norm": 1.0,
                           "compression_error": setting.error if lossy else 0.0, "residual_norm": 0.0,
                           "wire_bytes": sent * w, "dense_bytes": layer_bytes("none", {}, n, shape, w)})
        comm = comm_seconds(setting, wire, decoded, kinds)
        wire_total += wire * INTERVAL
        dense_total += dense_step * INTERVAL
        for rank in range(w):
            controller.ingest({
                "run_id": "projection", "rank": rank, "step": step, "epoch": 0, "plan_version": plan.version,
                "loss": 1.0, "step_seconds": setting.compute + comm, "compute_seconds": setting.compute,
                "comm_seconds": comm, "samples_per_second": 1000.0, "wire_bytes": wire_total,
                "dense_bytes": dense_total, "layers": layers})
    plan = controller.runs["projection"].plan
    details = controller.policies["projection"].details()
    predicted = details["predicted_step_s"]
    dense = setting.compute + dense_step / setting.bandwidth
    chosen = predicted[details["shift"]] if details["shift"] is not None and not details["dense"] else dense
    return {"plan": plan, "reason": plan.reason, "predicted": predicted, "dense_s": dense, "chosen_s": chosen,
            "gain": dense / chosen, "wire_ratio": dense_total / wire_total if wire_total else 1.0}


def _workload(config: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """The config's model's trainable shapes, and whether its optimizer suits the lossy rungs
    ("always" or "never", as ``raycomp.train`` resolves ``lossy: auto``)."""
    from jobs.config import load_config
    from jobs.workloads import build, optimizer_for
    from raycomp._internal.train.lossy import lossy_setting
    from raycomp.config.policy_options import AdaptiveOptions

    workload = load_config(Path(config)).workload
    model = build(workload, 0, 1, 0).model
    optimizer, _ = optimizer_for(workload, model, 1)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    return shapes, lossy_setting(AdaptiveOptions(), optimizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.projection", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a job config whose workload's model to project")
    parser.add_argument("--workers", type=int, required=True, help="ranks W (2 or more)")
    parser.add_argument("--link", required=True, help="per-rank link rate, e.g. 100mbit, 25gbit")
    parser.add_argument("--compute-ms", type=float, required=True, help="a step's compute without communication")
    parser.add_argument("--round-ms", type=float, default=ROUND_MS, help=f"an extra collective round (default {ROUND_MS:g} ms)")
    parser.add_argument("--decode-rate", help="bytes/s of all-gathered payload a rank decodes, e.g. 3.4e7 or "
                        "30mbps (default: Top-K's rate in docs/benchmarks/kernels.json)")
    parser.add_argument("--lossy", choices=("auto", "always", "never"), default="auto",
                        help="offer the lossy rungs (auto: as raycomp.train does for the config's optimizer)")
    parser.add_argument("--error", type=float, default=0.5, help="every lossy rung's relative error (default 0.5)")
    parser.add_argument("--intervals", type=int, default=30, help="control intervals to simulate (default 30)")
    args = parser.parse_args(argv)
    try:
        if args.workers < 2:
            raise ValueError(f"--workers: must be 2 or more, got {args.workers}")
        rate = parse_rate(args.link)
        if rate is None:
            raise ValueError(f"--link: a rate such as 100mbit or 25gbit, got {args.link!r}")
        if args.compute_ms <= 0 or args.round_ms < 0:
            raise ValueError("--compute-ms: must be > 0, --round-ms: >= 0")
        if args.decode_rate is None:
            decode_rate, decode_from = default_decode_rate()
        else:
            decode_rate, decode_from = parse_decode_rate(args.decode_rate), "--decode-rate"
        shapes, lossy = _workload(args.config)
        setting = Setting(args.workers, rate / 8, args.compute_ms / 1000, args.round_ms / 1000,
                          lossy if args.lossy == "auto" else args.lossy, args.error, decode_rate)
    except (ValueError, OSError) as error:
        print(f"python -m jobs.projection: {error}", file=sys.stderr)
        return 2
    out = project(shapes, setting, args.intervals)
    print(f"{args.config}: {sum(math.prod(s) for s in shapes.values()):,} parameters, W={args.workers}, "
          f"{args.link} per rank, compute {args.compute_ms:g} ms, round {args.round_ms:g} ms, lossy rungs {setting.lossy}")
    print(f"  all-gather decode at {decode_rate / 1e6:.3g} MB/s of payload ({decode_from})")
    print(f"  chooses: {out['plan'].summary(list(shapes))}  [{out['plan'].reason}]")
    print(f"  predicted step {out['chosen_s'] * 1e3:.1f} ms against dense {out['dense_s'] * 1e3:.1f} ms: "
          f"{out['gain']:.2f}x; {out['wire_ratio']:.1f}x fewer bytes over the simulated run")
    print("  every candidate (heaviest first, dense last), ms: "
          + ", ".join(f"{s * 1e3:.1f}" for s in out["predicted"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
