"""The cycle-cost table of the loop engine, the CPU's runtime engine before the one engine (the "before" table).

    python reports/measured/2026-11-29-cycle-cpu/loop_cycles.py --run-dir runs/default --out reports/measured/2026-11-29-cycle-cpu/before

The loop engine lives on as the tests' reference (jakiro_lib.decoding.reference, its code moved unchanged). Its steps
are timed by wrapping its functions in the package's step clock (decoding.clock.StepClock): the drafter's propose is
"draft" (its draft forwards "draft_forward"), the runner's tree forward "verify", the verification "evaluate", keeping
the path and the drafter's accept "update" (the accepted tokens' draft forward counts as a draft forward), the prefill
and the drafter's begin "prefill" (not a cycle's); what is left of a cycle is the host's. The rows then go through
the same arithmetic as `python -m jakiro_lib cycles` (measure.cycles.cycle_row), T(n) timed alone by the engine's
runner (the same forward), on the same methods, prompts and budgets.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pandas as pd

from jakiro_lib.decoding import clock as clock_module
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.decoding.reference import drafting, loop
from jakiro_lib.decoding.reference.drafting import make_drafter
from jakiro_lib.measure.cycles import COLUMNS, CYCLE_METHODS, _Timed, cycle_methods, cycle_prompts, cycle_row, verify_seconds
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.training.throughput import environment

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
CLOCK: list[StepClock | None] = [None]  # the clock the wrapped functions report to


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with clock_module.step(CLOCK[0], name):
            return fn(*args, **kwargs)
    return wrapper


def instrument() -> None:
    for cls in (drafting.FeatureDrafter, drafting.LookupDrafter):
        cls.propose = _timed("draft", cls.propose)
        cls.accept = _timed("update", cls.accept)
        cls.begin = _timed("prefill", cls.begin)
    DraftModel.forward = _timed("draft_forward", DraftModel.forward)
    loop.LoopRunner.tree = _timed("verify", loop.LoopRunner.tree)
    loop.LoopRunner.keep = _timed("update", loop.LoopRunner.keep)
    loop.LoopRunner.prefill = _timed("prefill", loop.LoopRunner.prefill)
    loop.LoopRunner.step = _timed("verify", loop.LoopRunner.step)  # plain decoding's one-token forward
    loop.verify = _timed("evaluate", loop.verify)


def generate(target, spec, draft, ids, max_new_tokens, clock):
    CLOCK[0] = clock
    common = dict(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    try:
        if spec.kind == "vanilla":
            return loop.vanilla_generate(target.model, ids, **common)
        return loop.speculative_generate(target.model, make_drafter(draft, spec.tree), ids, **common)
    finally:
        CLOCK[0] = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    instrument()
    profile = get_profile("default", **SETTINGS)
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, CYCLE_METHODS)
    prompts = cycle_prompts(profile, target, None)
    timings = {}
    for name, spec in methods.items():
        draft = DraftModel.load(spec.draft, target.model) if spec.draft else None
        generate(target, spec, draft, prompts[0], 8, None)  # first calls load kernels
        timed = _Timed(StepClock(target.device))
        for ids in prompts:
            timed.add(generate(target, spec, draft, ids, args.max_new_tokens, timed.clock))
        counted = StepClock(target.device, count_ops=True)
        with counted:
            r = generate(target, spec, draft, prompts[0], args.max_new_tokens, counted)
        counted.entries["cycle"] = r.cycles  # the loop has no cycle step of its own
        timed.clock.entries["cycle"] = timed.cycles
        timings[name] = (timed, counted)
        print(name, "done", flush=True)
    base = timings["vanilla"][0]
    plain_s = base.wall / base.cycles
    context = round(base.context / base.cycles)
    sizes = sorted({1, *(max(1, round(t.rows / t.cycles)) for t, _ in timings.values())})
    tn = verify_seconds(target, sizes, context=context)
    table = pd.DataFrame([cycle_row(n, t, c, plain_s, tn) for n, (t, c) in timings.items()], columns=list(COLUMNS))
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "cycles.csv", index=False)
    (args.out / "cycles_config.json").write_text(json.dumps({
        "engine": "loop (decoding.reference)", "profile": profile.to_dict(), "prompts": len(prompts),
        "methods": {k: {"draft": m.draft and Path(m.draft).parent.name, "tree": m.tree and m.tree.__dict__}
                    for k, m in methods.items()},
        "environment": environment(target.device)}, indent=2, default=str))
    print(table.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
