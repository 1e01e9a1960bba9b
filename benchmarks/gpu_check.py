"""The learner's inner step on a GPU: tokens/s and model FLOPs utilization, and a whole run on it.

    python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json            # on the device machine
    python benchmarks/gpu_check.py --device cpu --sizes tiny --steps 3 --warmup 1 --run-tokens 20000

The first line is the device check prepared for a session that is lent a GPU (issue 15: MFU of the
built-in GPT at a size that fills the device, target >= 40% in bf16); the second runs the same
code paths here, on the CPU, where no peak is known and MFU reads 0 (tests/unit/test_gpu_check.py).

The device image has torch (Python 3.12) but not every package of ours, and nothing can be fetched
there: download the missing wheels here once, into an ignored folder that the call carries
(`echo /.whl/ >> .git/info/exclude`), with the versions this project's venv holds:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl grpcio==1.85.3 protobuf==7.36.2 zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 \
        pycparser==3.12 rich==15.0.0

(not typer: the image's 0.27.2 serves the CLI, where a carried 0.29 imports pydantic, which the
image lacks and which then fails `diloco run`; seen on an H200 on 2026-12-04)

and run, carrying `.whl` (one call, timeout ~540 s):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD && python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json

Per model size, without and with `torch.compile`: the model is built as a learner builds it
(`build_model`), with the learner's AdamW (`make_inner_optimizer`, fused) and the learner's own
step (`inner_step`: bf16 autocast on CUDA, clipping, AdamW, the loss read back every step), on
random token rows copied from pinned memory. After --warmup steps (the compile's among them),
--steps steps are timed between two device synchronizations. Printed and written: tokens/s, ms
per step, peak device memory and MFU (`diloco.compute.mfu`: 6 x parameters FLOPs per token).
Then `diloco run` trains two learners on the device (train.device) for --run-tokens, and its
summary's per-learner tokens/s and MFU are added: the whole path (prefetch, pushes, pulls, merges)
next to the bare step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import run_diloco  # noqa: E402
from diloco.compute.inner import inner_step  # noqa: E402
from diloco.compute.mfu import mfu, peak_flops  # noqa: E402
from diloco.config import ModelConfig, TrainConfig, parse_assignments  # noqa: E402
from diloco.local.launch import default_run_config  # noqa: E402
from diloco.model.factory import build_model  # noqa: E402
from diloco.model.optim import make_inner_optimizer  # noqa: E402

# GPT sizes (n_layer, n_head, n_embd, seq_len, batch): "fill" is about 1.3 B parameters at batch
# 8 x 2048 tokens, a step large enough for the tensor cores to dominate; "medium" ~350 M.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64, "batch": 4},
    "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "seq_len": 1024, "batch": 16},
    "fill": {"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "batch": 8},
}
VOCAB = 50304  # GPT-2's, padded to a multiple of 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    size: str, device: torch.device, compile_model: bool, warmup: int, steps: int
) -> dict[str, Any]:
    shape = SIZES[size]
    vocab = VOCAB if size != "tiny" else 257
    model_cfg = ModelConfig(
        kwargs={k: shape[k] for k in ("n_layer", "n_head", "n_embd")}, seq_len=shape["seq_len"]
    )
    train = TrainConfig(batch_size=shape["batch"], warmup_steps=0, compile=compile_model)
    model = build_model(model_cfg, vocab_size=vocab, seed=0).to(device)
    optimizer = make_inner_optimizer(model, train)
    trained = torch.compile(model) if compile_model else model
    params = sum(p.numel() for p in model.parameters())
    rows = torch.randint(0, vocab, (shape["batch"], shape["seq_len"] + 1), dtype=torch.int64)
    columns = {"input_ids": rows.pin_memory() if device.type == "cuda" else rows}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for step in range(warmup):
        inner_step(trained, optimizer, columns, step=step, train=train, device=device)
    sync(device)
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(warmup, warmup + steps):
        loss, _ = inner_step(trained, optimizer, columns, step=step, train=train, device=device)
    sync(device)
    seconds = time.perf_counter() - started
    tokens_per_s = steps * shape["batch"] * shape["seq_len"] / seconds
    result = {
        "size": size, **shape, "params": params, "compile": compile_model, "device": str(device),
        "steps": steps, "ms_per_step": 1000 * seconds / steps, "warmup_s": warm_s,
        "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, params, peak_flops(device)),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "last_loss": loss,
    }  # fmt: skip
    del trained, model, optimizer
    if compile_model:
        # Inductor failed an assertion compiling the ~350 M model after the ~1.3 B one in the same
        # process (torch 2.11, H200); compiled alone it ran. A learner compiles one model.
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def whole_run(
    device: torch.device, tokens: int, folder: Path, minutes: float, overrides: dict[str, str]
) -> dict[str, Any]:
    """`diloco run` with two learners on the device: its summary's per-learner speed and MFU."""
    config = folder / "run.toml"
    run_config = default_run_config().with_overrides({"train.device": str(device), **overrides})
    config.write_text(run_config.to_toml())
    try:
        summary = run_diloco("gpu", [], config, tokens, 2, folder, max_minutes=minutes)
    except RuntimeError as e:  # the step figures above are still worth having
        return {"error": str(e)[-3000:]}
    keys = (
        "eval_loss", "tokens_trained", "learner_tokens_per_s", "utilization", "wall_seconds",
        "learners_detail", "params", "data_stall_share", "sync_wait_share", "goodput", "transfers",
    )  # fmt: skip
    return {k: summary.get(k) for k in keys}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="medium,fill", help=f"comma-separated, of: {', '.join(SIZES)}")
    p.add_argument("--compile", default="off,on", help="comma-separated: off, on")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--run-tokens", type=int, default=2_000_000, help="the whole run's budget (0: none)")
    p.add_argument("--run-minutes", type=float, default=4.0, help="the whole run's time limit")
    p.add_argument("--run-set", action="append", default=[], metavar="KEY=VALUE", help="the run's config")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    overrides = parse_assignments(args.run_set)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_bf16": peak_flops(device),
        "steps": [],
    }
    for size in args.sizes.split(","):
        for setting in args.compile.split(","):
            try:
                row = time_steps(size, device, setting == "on", args.warmup, args.steps)
            except Exception as e:  # one size out of memory must not lose the others' figures
                row = {"size": size, "compile": setting == "on", "error": f"{type(e).__name__}: {e}"[:2000]}
            report["steps"].append(row)
            print(json.dumps(row), flush=True)
            write(report, args.out)  # a device lease can end mid-check: keep what is measured
    if args.run_tokens > 0:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            report["run"] = whole_run(device, args.run_tokens, Path(tmp), args.run_minutes, overrides)
        print(json.dumps(report["run"]), flush=True)
        write(report, args.out)
    print(f"results: {args.out}")
    return report


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
