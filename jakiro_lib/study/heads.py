"""Released and exported heads in the study: stage 01 imports a draft whose ``DraftConfig.import_from`` names a head
instead of training it, and ``python -m jakiro_lib export`` writes a trained draft in EAGLE's or the Jakiro
authors' layout (:mod:`jakiro_lib.models.heads_io`; docs/DESIGN.md section 13)."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

from ..config import DraftConfig, Profile
from ..files import read_json, replace_dir_atomically, write_json
from ..layout import DRAFT_SUBDIR, RESULTS, TRAIN_STAMP, RunLayout, has_weights
from ..models.draft import DraftLoadError, DraftModel
from ..models.heads_io import export_head, import_head

log = logging.getLogger(__name__)

# what an imported head's DraftConfig must agree on with the profile's entry for it to describe the draft
ARCHITECTURE = ("mlp", "num_experts", "top_k_experts", "intermediate_size", "branch_b", "contrastive",
                "draft_vocab_size", "expert_mlp")


def import_draft(prof: Profile, layout: RunLayout, name: str, target: Any, stamp: dict[str, Any],
                 main_process: bool = True) -> dict[str, Any]:
    """Draft ``name`` imported from ``drafts.<name>.import_from`` into ``drafts/<name>/`` (``draft/``,
    ``results.json``, ``train_stamp.json``), replacing what was there only once complete. Returns its results."""
    source = str(prof.drafts[name].import_from)
    draft, info = import_head(source, target.model)
    _warn_if_other(prof.drafts[name], draft.cfg, name)
    res = {"imported": info, "draft_config": dataclasses.asdict(draft.cfg), "n_params": draft.n_params(),
           "intermediate_size": draft.mlp.experts[0].width, "skipped": False}
    if main_process:
        work = layout.draft_training(name)
        shutil.rmtree(work, ignore_errors=True)  # an interrupted import's or other configuration's folder
        draft.save(work / DRAFT_SUBDIR, imported=info)
        write_json(work / RESULTS, res)
        write_json(work / TRAIN_STAMP, stamp)
        replace_dir_atomically(work, layout.draft_dir(name))
    log.info("draft %s: imported from %s (%s layout, %d parameters), not trained", name, source, info["layout"],
             res["n_params"])
    return res


def _warn_if_other(asked: DraftConfig, got: DraftConfig, name: str) -> None:
    """One warning where the head's architecture is not what the profile's entry says (the head's is used)."""
    differ = [f"{k}={getattr(got, k)!r} (profile: {getattr(asked, k)!r})" for k in ARCHITECTURE
              if getattr(asked, k) != getattr(got, k)]
    if differ:
        log.warning("draft %s: the imported head's architecture is used, not the profile's: %s", name,
                    ", ".join(differ))


def saved_draft_dir(path: str | Path) -> Path:
    """A saved draft's weights folder from ``<run>/drafts/<name>`` or ``<run>/drafts/<name>/draft``."""
    path = Path(path).expanduser()
    if has_weights(path):
        return path
    if has_weights(path / DRAFT_SUBDIR):
        return path / DRAFT_SUBDIR
    raise DraftLoadError(f"no saved draft at {path} (give <run>/drafts/<name> or its draft/ folder)")


def export_draft(draft_path: str | Path, target: Any, fmt: str, out: str | Path) -> dict[str, Any]:
    """A saved draft written to ``out`` in ``fmt`` (``eagle``, ``eagle3``, ``jakiro``) for ``target``; returns
    what was written (layout, files)."""
    folder = saved_draft_dir(draft_path)
    draft = DraftModel.load(folder, target.model)
    written = export_head(draft, target.model, fmt, out, origin=str(folder.resolve()))
    config = read_json(written / "config.json") or {}
    return {"out": str(written), "layout": config.get("jakiro_lib", {}).get("layout"),
            "files": sorted(p.name for p in written.iterdir())}
