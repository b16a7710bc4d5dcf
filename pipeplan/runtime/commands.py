"""`pipeplan run`: execute a plan on this machine (all its ranks, through torch's elastic launcher)."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeplan.console import out
from pipeplan.errors import ConfigError
from pipeplan.paths import check_output_dir, check_output_file
from pipeplan.runtime.config import CLIP_HELP, POST_VALIDATE_HELP, RunConfig, heartbeat_timeout_from_env


def run(
    plan: Path = typer.Argument(..., help="plan.json written by `pipeplan plan`."),
    steps: int = typer.Option(10, "--steps", help="Training steps (total, counting resumed ones)."),
    trace: str | None = typer.Option(None, "--trace", help="Write the measured Chrome trace of the last step here."),
    checkpoint_dir: str | None = typer.Option(None, "--checkpoint-dir", help="Save per-stage checkpoints here."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Steps between checkpoints (0: at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --checkpoint-dir."),
    init_from: Path | None = typer.Option(
        None,
        "--init-from",
        help="Initial weights: a whole-model state_dict (.pt, .safetensors or a directory of .safetensors shards); "
        "each rank reads only its stages' tensors.",
    ),
    lr: float | None = typer.Option(None, "--lr", help="AdamW learning rate (default: the plan's)."),
    weight_decay: float | None = typer.Option(None, "--weight-decay", help="AdamW weight decay (default: the plan's)."),
    heartbeat_timeout: float | None = typer.Option(
        None, "--heartbeat-timeout", help="Seconds without a peer's heartbeat before every rank stops (default 60)."
    ),
    device: str | None = typer.Option(
        None, "--device", help="cpu (gloo) or cuda (nccl, one GPU per rank); default: the plan's device."
    ),
    precision: str | None = typer.Option(
        None,
        "--precision",
        help="fp32, bf16-mixed, fp16-mixed (CUDA) or bf16; must be the plan's (default), e.g. --precision bf16-mixed.",
    ),
    threads: int | None = typer.Option(
        None, "--threads", help="CPU threads per rank (default on CPU: the cores divided by the ranks on this machine)."
    ),
    clip_grad_norm: float | None = typer.Option(None, "--clip-grad-norm", help=CLIP_HELP),
    post_validate: bool = typer.Option(False, "--post-validate", help=POST_VALIDATE_HELP),
) -> None:
    """Run a plan's ranks locally on torch.distributed (gloo on CPU, nccl on CUDA: the plan's device unless
    --device says otherwise) and compare the measured step time with the plan's prediction. Across nodes, use
    the plan's launch.sh (torchrun -m pipeplan.runtime.worker).

    Without --init-from, every rank's tensors are exactly what the model's factory builds for the whole model with
    the plan's seed (torch.manual_seed(seed), then build()).

    Example: pipeplan run out/plan.json --steps 20 --trace out/measured.json
    Example: pipeplan run plan/plan.json --init-from weights.safetensors
    """
    from pipeplan.runtime.launch import launch_local  # torch.distributed import only when running

    trace = check_output_file(trace, "--trace") if trace is not None else None
    checkpoint_dir = check_output_dir(checkpoint_dir, "--checkpoint-dir") if checkpoint_dir is not None else None
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if init_from is not None and not init_from.exists():
        raise ConfigError(f"--init-from {str(init_from)!r} does not exist")
    config = RunConfig(
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
        trace_path=str(trace) if trace else None,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        checkpoint_every=checkpoint_every,
        resume=resume,
        init_from=str(init_from.resolve()) if init_from else None,
        heartbeat_timeout_s=heartbeat_timeout if heartbeat_timeout is not None else heartbeat_timeout_from_env(),
        device=device,
        precision=precision,
        clip_grad_norm=clip_grad_norm,
        post_validate=post_validate,
    )
    results = launch_local(plan, config, threads=threads)
    if trace:
        out.print(f"measured trace: {trace}", highlight=False)
    if checkpoint_dir:
        out.print(
            f"checkpoints: {checkpoint_dir} (step {results[0].first_step + len(results[0].losses)})", highlight=False
        )
