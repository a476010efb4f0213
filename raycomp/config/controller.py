"""``controller``: how often the ranks meet the controller, and which controller service they
talk to; :func:`host_literal`, the syntax of its metrics endpoint's address."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from raycomp.config.base import Strict

_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_literal(value: str) -> str:
    """``value`` if it is an IPv4/IPv6 address or a syntactically valid host name (RFC 1123).

    Pure syntax (no network): whether a name resolves is checked before a job starts.
    A dotted string of numbers must be a valid IPv4 address, so ``0.0.0.0.0`` and
    ``256.1.1.1`` are refused here rather than looked up as names.
    """
    allowed = "an IPv4 or IPv6 address (e.g. 127.0.0.1, ::1) or a host name (e.g. localhost)"
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if not value or len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"must be {allowed}, got {value!r}")
    if labels[-1].isdigit():  # all-numeric top label: meant as an IPv4 address
        raise ValueError(f"{value!r} is not a valid IPv4 address; must be {allowed}")
    return value


class ControllerSection(Strict):
    """``controller``: how often the ranks meet the controller, and which controller service
    (a Ray actor) they talk to, with its snapshots, restarts and metrics endpoint."""

    config_key = "controller"

    #: K, steps between two control boundaries: statistics go to the controller, a new plan
    #: comes back and the ranks check they agree, every K steps and never in between
    interval_steps: Annotated[int, Field(ge=1, le=100_000)] = 10
    #: one boundary more, after the run's first this many steps (when fewer than K): a
    #: policy whose warm-up chooses from the link's measured speed (the adaptive default)
    #: then has it after 3 dense steps, not K. On a 100 Mbit/s link a dense step of a
    #: 10 MB model takes about a second; the statistics of so short an interval hold no
    #: layer statistics yet (those come every K steps)
    first_interval_steps: Annotated[int, Field(ge=1, le=100_000)] = 3
    #: how the guard's values and rank 0's new plan reach every rank on a dense step that
    #: DDP's own reduction carries, where no collective of raycomp's runs. ``at_boundaries``:
    #: none while the guard is not in fallback, so such a step costs what plain DDP's does
    #: (no collective round of raycomp's); the ranks agree two steps after each boundary
    #: (the controller's answer to its statistics is in force from the step after, unless
    #: it took longer: then from the next agreement), and that agreement's all-gather
    #: carries the losses of those steps to the guard. ``every_step``: a tiny all-reduce of
    #: their own each such step (a plan is in force two steps after it arrives, whenever
    #: that is; every loss is judged on its step), a little CPU every step
    #: (docs/benchmarks/README.md). A non-finite
    #: gradient is caught on its step either way (the mean's norm), and compressed steps
    #: carry the values in their own collectives
    dense_control: Literal["every_step", "at_boundaries"] = "at_boundaries"
    #: the controller actor's name (runs that name the same one share it)
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp-controller"
    #: the Ray namespace of the controller actor
    namespace: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp"
    #: where the controller keeps its state across restarts (None: ``jobs.train`` uses
    #: ``<storage_path>/_controller``; ``raycomp.train.ControllerCallback`` keeps it in memory)
    snapshot_dir: str | None = None
    #: Ray's ``max_restarts`` of the controller actor (-1: restart it without limit)
    max_restarts: Annotated[int, Field(ge=-1)] = -1
    #: whether the controller serves Prometheus metrics
    metrics_enabled: bool = True
    #: the metrics endpoint's address (loopback unless you mean to expose it)
    metrics_host: str = "127.0.0.1"
    #: the metrics endpoint's port (0: pick a free port)
    metrics_port: Annotated[int, Field(ge=0, le=65_535)] = 9478
    #: Prometheus file-SD list (default: /tmp/raycomp/prometheus/<name>.json)
    metrics_sd_file: str | None = None
    #: seconds a finished run's state stays at the controller (its metrics still exported)
    #: before it is dropped
    finished_run_grace_s: Annotated[float, Field(ge=0)] = 300.0
    #: a worker that finds no service of this name fails at ``prepare_model`` with a one-line
    #: error; False: it trains dense, uncompressed, for the whole run (and warns so)
    required: bool = True

    _host = field_validator("metrics_host")(lambda cls, value: host_literal(value))


__all__ = ["ControllerSection", "host_literal"]
