"""The Python API end to end on a tiny model (README, "Python API"): profile -> plan -> save/load -> simulate -> run.

Run it: python examples/api_example.py [OUTPUT_DIR]
"""

import sys
from pathlib import Path

import pipeplan


def main(out: Path) -> None:
    model = {"layers": 4, "hidden": 32}  # the CLI's -a layers=4 -a hidden=32

    # profile: a built-in name, file.py:factory, a ModelSpec, or an nn.Module with example_batch= and loss_fn=
    profile = pipeplan.profile("mlp", assignments=model, batch_size=2, repeats=2, output=str(out / "profile.json"))
    print(f"{len(profile.layers)} layers profiled")

    # plan: `pipeplan plan`'s options as keywords (--devices -> devices, -B -> global_batch_size)
    plan = pipeplan.plan("mlp", assignments=model, profile=profile, devices=2, global_batch_size=8, parallel="pp=2")
    print(f"{plan.schedule}: {len(plan.stages)} stages, predicted {plan.predicted.step_ms:.2f} ms per step")

    plan.save(out / "plan.json")
    assert pipeplan.Plan.load(out / "plan.json") == plan

    # simulate: one schedule with uniform per-device costs, as `pipeplan simulate` does
    simulation = pipeplan.simulate(schedule="zb-h1", stages=4, microbatches=8)
    print(f"zb-h1: makespan {simulation.metrics['makespan_ms']:.1f} ms, bubble {simulation.metrics['bubble_rate']:.1%}")

    # run: the plan's ranks on this machine (gloo on CPU), as `pipeplan run` does; a RunResult per rank
    results = pipeplan.run(plan, steps=2, quiet=True, threads=1)
    print(f"losses: {[round(loss, 4) for loss in results[0].losses]}")


if __name__ == "__main__":  # run() starts its ranks as new processes, which import this file
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "api-demo"))
