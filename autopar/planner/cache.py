"""A cache of solved plans, keyed by everything a plan is a function of.

Key: the captured graph's fingerprint (ops, shapes, dtypes, constant arguments), the mesh (shape,
axis names), the device profile's full contents, every planning option that can change the plan
(`key_options`: the time limit too, as a plan cut short by it must not be served to a longer
call), and a hash of autopar's own source (a new cost model must not serve old plans). Enabled by
`cache_dir=` or `AUTOPAR_CACHE_DIR`.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

from ..errors import PlanFileError
from ..mesh import Mesh
from ..plan import Plan

ENV = "AUTOPAR_CACHE_DIR"


@lru_cache(maxsize=1)
def _code_hash() -> str:
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


# PlanOptions fields that cannot change the plan: how planning reports progress and where it caches
NOT_KEYED = ("progress", "cache_dir", "on_phase")


def key_options(options) -> dict:
    """The options a cached plan is a function of: every `PlanOptions` field but NOT_KEYED."""
    d = options.to_dict()
    d["time_limit"] = options.time_limit
    return d


class PlanCache:
    def __init__(self, directory: Path):
        self.dir = directory

    @classmethod
    def open(cls, directory: str | None) -> PlanCache | None:
        directory = directory or os.environ.get(ENV)
        return cls(Path(directory)) if directory else None

    def key(self, fingerprint: str, mesh: Mesh, options) -> str:
        """`options`: the `PlanOptions` of the call."""
        prof = mesh.profile
        profile = {f.name: repr(getattr(prof, f.name)) for f in fields(prof) if f.name != "peak_flops"}
        profile["peak_flops"] = dict(sorted(prof.peak_flops.items()))
        blob = json.dumps([fingerprint, mesh.to_dict(), profile, key_options(options), _code_hash()], sort_keys=True,
                          default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def get(self, key: str) -> Plan | None:
        path = self.dir / f"{key}.json"
        if not path.exists():
            return None
        try:
            return Plan.load(path)      # read as data: checked field by field, nothing evaluated
        except PlanFileError as e:
            warnings.warn(f"plan cache: ignoring an invalid entry, solving again: {e}", stacklevel=3)
            return None

    def put(self, key: str, plan: Plan) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(plan.to_json())
        tmp.replace(self.dir / f"{key}.json")      # atomic: concurrent ranks never read half a file
