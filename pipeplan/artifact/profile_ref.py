"""The profile a plan was made from, as plan.json records it (`Plan.profile`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ProfileRef:
    """The profile the plan's costs come from (written beside plan.json as profile.json): what `run` records in
    its trace and `refine` checks a profile file against, and the CPU threads it was measured with (a run whose
    ranks use another count says so)."""

    fingerprint: str  # Profile.fingerprint of profile.json
    source: str = "measured"  # measured | analytic | pipedream
    threads: int | None = None  # Provenance.threads: torch's CPU threads while measuring (None: not recorded)
    refined_from: str = ""  # Provenance.refined_from: the run a refined profile learned from
