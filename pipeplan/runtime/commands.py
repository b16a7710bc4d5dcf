"""`pipeplan run`: execute a plan on this machine (all its ranks, through torch's elastic launcher);
`pipeplan export-weights`: a checkpoint of it as one state_dict."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.console import out
from pipeplan.options import command
from pipeplan.runtime.launch.run_options import RunOptions


@command(RunOptions)
def run(options: RunOptions) -> None:
    """Run a plan's ranks locally on torch.distributed (gloo on CPU, nccl on CUDA: the plan's device unless
    --device says otherwise) and compare the measured step time with the plan's prediction. Across nodes, use
    the plan's launch.sh (torchrun -m pipeplan.runtime.launch.worker, which takes these same options).

    Without --init-from, every rank's tensors are exactly what the model's factory builds for the whole model with
    the plan's seed (torch.manual_seed(seed), then build()).

    Example: pipeplan run out/plan.json --steps 20 --trace out/measured.json
    Example: pipeplan run plan/plan.json --init-from weights.safetensors
    Example: pipeplan run plan/plan.json --steps 100 --lr-schedule cosine --warmup-steps 10 --log train.jsonl
    """
    from pipeplan.runtime.launch.local import launch_local  # torch.distributed import only when running

    results = launch_local(options.plan, options, threads=options.threads)  # options: the ranks' RunConfig
    if options.trace_path:
        out.print(f"measured trace: {options.trace_path}", highlight=False)
    if options.checkpoint_dir:
        step = results[0].first_step + len(results[0].losses)
        out.print(f"checkpoints: {options.checkpoint_dir} (step {step})", highlight=False)


def export_weights(
    checkpoint_dir: Path = typer.Argument(..., help="A --checkpoint-dir that `pipeplan run` wrote."),
    output: str = typer.Option(..., "--output", "-o", help="A .safetensors file, or a directory for shards."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step to export (default: the newest)."),
    plan_file: str | None = typer.Option(None, "--plan", help="The run's plan, for checkpoints without plan.json."),
    shard_gb: float = typer.Option(5.0, "--shard-gb", help="Largest shard of a directory output, in GB."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
) -> None:
    """Write a checkpoint of `pipeplan run` as the whole model's state_dict, under the names
    `model.state_dict()` has (what --init-from reads): one .safetensors file, or a directory of shards with
    model.safetensors.index.json (and config.json for an hf: model, so from_pretrained(DIR) loads it).

    Example: pipeplan export-weights ckpt -o model.safetensors
    Example: pipeplan export-weights ckpt -o trained/ --shard-gb 2
    """
    from pipeplan.runtime.export_weights import export_weights as export

    done = export(checkpoint_dir, output, step=step, plan_file=plan_file, shard_gb=shard_gb, force=force)
    where = output if len(done.files) == 1 else f"{output} ({len(done.files)} files)"
    out.print(f"step {done.step}: {done.keys} tensors -> {where}", highlight=False)
    if done.initial:
        shown = ", ".join(done.initial[:3]) + (", ..." if len(done.initial) > 3 else "")
        out.print(f"{len(done.initial)} untrained buffer(s) from the run's initial weights: {shown}", highlight=False)
    if done.config_written:
        out.print(f"config.json written: transformers' from_pretrained({output!r}) loads it", highlight=False)
