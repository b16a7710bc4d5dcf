"""`pipeplan run`: execute a plan on this machine (all its ranks, through torch's elastic launcher)."""

from __future__ import annotations

from pipeplan.console import out
from pipeplan.options import command
from pipeplan.runtime.run_options import RunOptions


@command(RunOptions)
def run(options: RunOptions) -> None:
    """Run a plan's ranks locally on torch.distributed (gloo on CPU, nccl on CUDA: the plan's device unless
    --device says otherwise) and compare the measured step time with the plan's prediction. Across nodes, use
    the plan's launch.sh (torchrun -m pipeplan.runtime.worker, which takes these same options).

    Without --init-from, every rank's tensors are exactly what the model's factory builds for the whole model with
    the plan's seed (torch.manual_seed(seed), then build()).

    Example: pipeplan run out/plan.json --steps 20 --trace out/measured.json
    Example: pipeplan run plan/plan.json --init-from weights.safetensors
    Example: pipeplan run plan/plan.json --steps 100 --lr-schedule cosine --warmup-steps 10 --log train.jsonl
    """
    from pipeplan.runtime.launch import launch_local  # torch.distributed import only when running

    results = launch_local(options.plan, options, threads=options.threads)  # options: the ranks' RunConfig
    if options.trace_path:
        out.print(f"measured trace: {options.trace_path}", highlight=False)
    if options.checkpoint_dir:
        step = results[0].first_step + len(results[0].losses)
        out.print(f"checkpoints: {options.checkpoint_dir} (step {step})", highlight=False)
