"""`hf:` models against the built-ins of the same shape (issue 35), through the CLI as a user types it: analytic
profiles (`pipeplan profile MODEL --device meta --hardware h100 --precision bf16-main -b 1`) at published widths with
two blocks (every per-block figure is the full model's; depth only repeats it). For each family, the hf: model's
figure relative to the built-in's: total parameters, forward FLOPs per token, bytes crossing the cut into the blocks,
and per block (dense, and the MoE one where there is one) saved bytes and F / I / W times, and the final norm and
head's F + I + W. Then `pipeplan capacity ... --json` (the search, bf16-main) of DeepSeek-V3's shape with
CAPACITY_LAYERS blocks (one dense, the rest MoE; the full 61 is too slow to sweep on a 2-core VM) on 64 H100, seq
4096, 256 sequences, as `hf:deepseek_v3` and as the built-in: the layout each chooses and its step. Prints a table
and writes results/hf_agreement.json; not a test (tests/models/test_hf_agreement.py holds the agreement the docs
state)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results" / "hf_agreement.json"
LAYERS = 2
CAPACITY_LAYERS = 4  # DeepSeek-V3's capacity comparison: its first block dense, the others MoE

FAMILIES = {  # (hf: model, its fields), (built-in, its options), both at LAYERS blocks
    "llama (Llama-2-7B)": (
        (
            "hf:llama",
            dict(
                hidden_size=4096,
                num_attention_heads=32,
                num_key_value_heads=32,
                intermediate_size=11008,
                vocab_size=32000,
                seq_len=4096,
                max_position_embeddings=4096,
                num_hidden_layers=LAYERS,
            ),
        ),
        ("llama", dict(hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000, seq=4096, layers=LAYERS)),
    ),
    "mistral (Mistral 7B)": (("hf:mistral-7b", dict(num_hidden_layers=LAYERS)), ("mistral-7b", None)),
    "qwen2 (Qwen2.5 7B)": (("hf:qwen2.5-7b", dict(num_hidden_layers=LAYERS)), ("qwen2.5-7b", None)),
    "gemma (Gemma 7B)": (
        (
            "hf:gemma",
            dict(
                hidden_size=3072,
                num_attention_heads=16,
                num_key_value_heads=16,
                head_dim=256,
                intermediate_size=24576,
                vocab_size=256000,
                seq_len=4096,
                num_hidden_layers=LAYERS,
            ),
        ),
        (
            "llama",
            dict(
                hidden=3072,
                heads=16,
                kv_heads=16,
                head_dim=256,
                intermediate=24576,
                vocab=256000,
                seq=4096,
                activation="gelu_tanh",
                tie_embeddings=True,
                layers=LAYERS,
            ),
        ),
    ),
    "gpt2 (GPT-2 XL)": (
        ("hf:gpt2", dict(n_embd=1600, n_head=25, vocab_size=50257, seq_len=1024, n_layer=LAYERS)),
        ("gpt", dict(hidden=1600, heads=25, vocab=50257, seq=1024, tie_embeddings=True, dropout=0.1, layers=LAYERS)),
    ),
    "mixtral (Mixtral 8x7B)": (
        (
            "hf:mixtral",
            dict(
                hidden_size=4096,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=32000,
                seq_len=4096,
                num_hidden_layers=LAYERS,
            ),
        ),
        ("mixtral-8x7b", None),
    ),
    "deepseek_v3 (DeepSeek-V3)": (
        ("hf:deepseek_v3", dict(first_k_dense_replace=1, seq_len=4096, num_hidden_layers=LAYERS)),
        ("deepseek-v3", dict(dense_layers=1)),
    ),
}


PIPEPLAN = shutil.which("pipeplan", path=str(Path(sys.executable).parent)) or "pipeplan"


def _model_args(ref: str, options: dict | None) -> list[str]:
    """`MODEL -a key=value ...` as a user types it: a built-in preset's own options with LAYERS blocks."""
    from pipeplan.models import load_model

    if options is None or (not ref.startswith("hf:") and ref not in ("llama", "gpt")):  # a built-in preset
        preset = load_model(ref)
        ref = "moe" if preset.name == "moe" else preset.name
        options = {**preset.options, "layers": LAYERS, **(options or {})}
    return [ref, *(part for key, value in options.items() for part in ("-a", f"{key}={value}"))]


def _cli(*args: str) -> str:
    """One pipeplan command's stdout; a failure stops the benchmark with the command's own last line."""
    done = subprocess.run([PIPEPLAN, *args], capture_output=True, text=True)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise SystemExit(f"pipeplan {' '.join(args)}: {last}")
    return done.stdout


def _figures(ref: str, options: dict | None, folder: Path) -> dict:
    from pipeplan.profiling.profile import Profile
    from pipeplan.search.stack import transformer_layers

    path = folder / f"{ref.replace(':', '_')}.json"
    meta = ("--device", "meta", "--hardware", "h100", "--precision", "bf16-main", "-b", "1", "-o", str(path))
    _cli("profile", *_model_args(ref, options), *meta)
    profile = Profile.load(path)
    roles = transformer_layers(profile)
    layers = profile.layers
    first, last = layers[roles.first_block], layers[roles.end_block - 1]
    figures = dict(
        params=sum(la.param_count for la in layers),
        flops_per_token=sum(la.flops for la in layers) / profile.provenance.tokens_per_sample,
        cut_bytes=profile.cut_bytes[roles.first_block],
        head_ms=sum(la.forward_ms + la.input_grad_ms + la.weight_grad_ms for la in layers[roles.end_block :]),
    )
    for tag, block in (("block", first), ("moe_block", last if last.expert_param_count else None)):
        if block is not None:
            figures.update({f"{tag}_saved_bytes": block.activation_bytes, f"{tag}_F_ms": block.forward_ms})
            figures.update({f"{tag}_I_ms": block.input_grad_ms, f"{tag}_W_ms": block.weight_grad_ms})
    return figures


def _capacity(devices: int = 64, batch: int = 256) -> dict:
    """DeepSeek-V3's shape (CAPACITY_LAYERS blocks) through `pipeplan capacity ... --json` as hf:deepseek_v3 and as
    the built-in moe with the deepseek-v3 preset's options: each one's chosen layout and step, and the difference."""
    from pipeplan.models import load_model

    builtin = {**load_model("deepseek-v3").options, "layers": CAPACITY_LAYERS, "dense_layers": 1}
    builtin.pop("seq")  # capacity's --seq
    hf = dict(num_hidden_layers=CAPACITY_LAYERS, first_k_dense_replace=1)
    cluster = ("--seq", "4096", "--hardware", "h100", "--devices", str(devices), "-B", str(batch))
    found = {}
    for tag, model, options in (("hf", "hf:deepseek_v3", hf), ("builtin", "moe", builtin)):
        model_args = [model, *(part for key, value in options.items() for part in ("-a", f"{key}={value}"))]
        report = json.loads(_cli("capacity", *model_args, *cluster, "--precision", "bf16-main", "--json"))
        (row,) = report["rows"]
        layout = (row["schedule"], row["tensor_parallel"], row["expert_parallel"])
        layout += (row["pipeline_devices"], row["data_parallel"])
        found[tag] = dict(layout="{} t={} ep={} {}x{}".format(*layout), step_ms=row["step_ms"], mfu=row["mfu"])
    found["step_pct"] = 100 * (found["hf"]["step_ms"] / found["builtin"]["step_ms"] - 1)
    found.update(devices=devices, global_batch_size=batch, seq=4096, layers=CAPACITY_LAYERS, precision="bf16-main")
    return found


def main() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    rows = {}
    with tempfile.TemporaryDirectory(prefix="hf_agreement-") as folder:
        for family, ((hf_ref, hf_options), (ref, options)) in FAMILIES.items():
            hf, builtin = _figures(hf_ref, hf_options, Path(folder)), _figures(ref, options, Path(folder))
            rows[family] = {
                key: dict(hf=hf[key], builtin=builtin[key], pct=100 * (hf[key] / builtin[key] - 1)) for key in hf
            }
            shown = ", ".join(f"{key} {row['pct']:+.1f}%" for key, row in rows[family].items())
            print(f"{family}: {shown}", flush=True)
    capacity = _capacity()
    hf, builtin = capacity["hf"], capacity["builtin"]
    print(
        f"capacity deepseek_v3 ({CAPACITY_LAYERS} blocks, 64 H100, 256 x 4096): hf {hf['layout']} "
        f"{hf['step_ms']:,.1f} ms, built-in {builtin['layout']} {builtin['step_ms']:,.1f} ms "
        f"({capacity['step_pct']:+.2f}%)",
        flush=True,
    )
    record = dict(schema_version=1, machine=platform.node() or "vm", layers=LAYERS, hardware="h100", rows=rows)
    record["capacity_deepseek_v3"] = capacity
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
