"""Train a small LLaMA-style language model on real text with autopar, as a user starts a run.

    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,tp=2 --steps 50 --out runs/x
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,tp=2 --steps 80 --out runs/x --resume
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=4 --steps 80 --out runs/x --resume   # another mesh
    python examples/train_lm.py --fault-tolerant --mesh dp=2,tp=2 --steps 40 --out runs/ft   # examples/lm_fault_tolerant.py

The text is the Python standard library's own sources (present wherever Python is), 9/10 for
training and 1/10 for validation, tokenized by a byte-level BPE trained on it (cached in
``OUT/data``). The model (examples/lm_model.py: RMSNorm, RoPE, SwiGLU, grouped-query attention,
LlamaForCausalLM's names) is planned by ``ap.parallelize`` on ``--mesh`` (axes dp, tp, pp, cp; ``--auto``
lets autopar's search choose what each axis does), trained with AdamW (warm-up, cosine decay),
``ap.clip_grad_norm_`` and gradient accumulation. It writes:

    OUT/metrics.jsonl   one JSON object per step (step, loss, lr, grad_norm, tokens_per_s, ...) and
                        per validation ("kind": "val", "val_loss"); every row has "run" (0, then 1, ...
                        for each resume), so nothing is overwritten
    OUT/loss.png        training and validation loss
    OUT/ckpt/step_N/    DCP checkpoints through ap.get_state_dict (model, optimizer; trainer.json:
                        scheduler, data position, RNG); OUT/ckpt/latest names the last complete one
    OUT/hf/             ap.save_pretrained: a directory transformers' LlamaForCausalLM and
                        AutoTokenizer load; rank 0 reloads it, generates from a prompt and prints it
    OUT/sample.txt      that generated text

See docs/train_lm.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from tqdm import tqdm

import autopar as ap
from lm_data import TokenLoader, corpus_files, corpus_split, encode, load_or_train_tokenizer
from lm_model import LlamaLM, llama_config, megatron

# What defines a run: kept in OUT/run.json, taken from there on --resume (a different value given
# on the command line is refused). Everything else (--steps, --mesh, techniques, intervals) may change.
RUN_DEFAULTS = {
    "vocab": 264,  # byte-level BPE: 256 bytes, <|endoftext|>, 7 merges (docs/train_lm.md: why not 1024)
    "hidden": 128,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "seq": 128,
    "batch": 16,
    "accum": 1,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 10,
    "weight_decay": 0.1,
    "clip": 1.0,
    "corpus_mb": 5.0,
    "seed": 0,
}
RUN_HELP = {
    "vocab": "BPE vocabulary size (264: byte level plus 7 merges)",
    "hidden": "model width",
    "layers": "decoder blocks",
    "heads": "query heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "seq": "tokens per row",
    "batch": "rows per micro-step, all ranks together",
    "accum": "micro-steps per optimizer step (gradient accumulation)",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay (none on the norms)",
    "clip": "gradient norm clipped to this (ap.clip_grad_norm_)",
    "corpus_mb": "megabytes of standard-library sources read",
    "seed": "model initialisation and sampling seed",
}
AXES = {
    "dp": "data parallel",
    "tp": "tensor parallel (Megatron)",
    "pp": "pipeline stages",
    "cp": "context parallel (sequences split, ring attention, load balanced)",
}
NOT_YET = {"sp": "use tp: sequence parallel rides on it"}
PROMPT = "def read_config(path):\n"


class Usage(Exception):
    """Bad input: printed once, as argparse prints its errors, before anything is written."""


# ----------------------------------------------------------------------------- command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a LLaMA-style LM on the Python standard library's sources with autopar.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "mesh axes: dp (data parallel), tp (tensor parallel, Megatron), pp (pipeline stages), cp "
            "(context parallel: every sequence split, ring attention); their sizes multiply to the "
            "number of processes."
        ),
    )
    p.add_argument("--out", required=True, help="output directory (must not exist unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint (any mesh)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps in all (default 50)")
    p.add_argument("--mesh", default=None, help="e.g. dp=2,tp=2 or dp=2,pp=2 (default: dp=<processes>)")
    p.add_argument("--auto", action="store_true", help="autopar's search chooses each axis' role and split layers")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO level on the dp axis")
    p.add_argument("--bf16", action="store_true", help="bf16 compute from fp32 parameters (needs a dp axis)")
    p.add_argument("--compile", action="store_true", help="torch.compile the rank module (not with pp)")
    p.add_argument(
        "--checkpoint",
        choices=("full", "selective"),
        default=None,
        help="activation checkpointing of every block (ap.ActivationCheckpoint: recompute in backward)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default 2 x pp)")
    p.add_argument("--eval-every", type=int, default=10, help="validation every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--ckpt-every", type=int, default=25, help="checkpoint every N steps (and at the end)")
    p.add_argument("--sample-tokens", type=int, default=80, help="tokens generated at the end")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="replica groups on dp that survive a lost one (torchft; run with plain python: it launches them)",
    )
    p.add_argument("--kill-at", type=int, default=None, help="--fault-tolerant demo: kill a process at step N")
    run = p.add_argument_group("the run (kept in OUT/run.json; fixed on --resume)")
    for name, default in RUN_DEFAULTS.items():
        flag = f"--{name.replace('_', '-')}"
        run.add_argument(flag, type=type(default), default=None, help=f"{RUN_HELP[name]} (default {default})")
    return p.parse_args(argv)


def parse_mesh(text: str | None, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """'dp=2,tp=2' -> ((2, 2), ('dp', 'tp')), checked against the process count."""
    if text is None:
        return (world,), ("dp",)
    shape, names = [], []
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if name in NOT_YET:
            raise Usage(f"--mesh {text}: {name}: {NOT_YET[name]} (axes: {', '.join(AXES)})")
        if name not in AXES or not size.isdigit() or int(size) < 1:
            raise Usage(f"--mesh {text}: give AXIS=SIZE pairs, axes {', '.join(AXES)} (e.g. dp=2,tp=2)")
        if name in names:
            raise Usage(f"--mesh {text}: axis {name} is given twice")
        shape.append(int(size))
        names.append(name)
    size = math.prod(shape)
    if size != world:
        raise Usage(
            f"--mesh {text} has {size} ranks but {world} processes were started: "
            f"run torchrun --nproc-per-node {size}, or give a mesh whose sizes multiply to {world}"
        )
    return tuple(shape), tuple(names)


def run_settings(args, out: str) -> dict:
    """The run's settings: OUT/run.json's on --resume (the command line may not differ), else the
    command line's over RUN_DEFAULTS."""
    given = {k: getattr(args, k) for k in RUN_DEFAULTS if getattr(args, k) is not None}
    if not args.resume:
        return {**RUN_DEFAULTS, **given}
    if not os.path.exists(os.path.join(out, "run.json")):
        raise Usage(f"--resume: {out} has checkpoints but no run.json: it was not written by this script")
    with open(os.path.join(out, "run.json")) as f:
        saved = json.load(f)["run"]
    differs = {k: (v, saved[k]) for k, v in given.items() if saved.get(k) != v}
    if differs:
        k, (v, s) = next(iter(differs.items()))
        raise Usage(f"--{k.replace('_', '-')} {v}: this run was started with {s}; a resumed run keeps its settings")
    return saved


def check_input(args, world: int) -> tuple[dict, tuple, tuple]:
    """Every refusal that needs no process group, before anything is written."""
    out = args.out
    latest = os.path.join(out, "ckpt", "latest")
    if args.resume and not os.path.exists(latest):
        raise Usage(
            f"--resume: nothing to resume in {out} (no {latest}: no checkpoint was completed there); "
            "start without --resume"
        )
    if not args.resume and os.path.exists(out) and os.listdir(out):
        raise Usage(f"--out {out} exists and is not empty: add --resume to continue it, or give a new --out")
    shape, names = parse_mesh(args.mesh, world)
    run = run_settings(args, out)
    sizes = dict(zip(names, shape))
    dp, tp, pp = sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("pp", 1)
    if run["heads"] % run["kv_heads"] or run["hidden"] % run["heads"]:
        raise Usage(f"--heads {run['heads']} must divide --hidden and be a multiple of --kv-heads")
    if not args.auto and (run["kv_heads"] % tp or run["vocab"] % tp):
        raise Usage(f"tp={tp} must divide --kv-heads ({run['kv_heads']}) and --vocab ({run['vocab']})")
    micro = args.microbatches or 2 * pp
    if run["batch"] % dp or (pp > 1 and (run["batch"] // dp) % micro):
        raise Usage(
            f"--batch {run['batch']} must split over dp={dp}" + (f" and then {micro} micro-batches" if pp > 1 else "")
        )
    if pp > 1 and (args.auto or args.compile or run["accum"] > 1):
        raise Usage(
            "pp: --auto does not choose pipeline stages yet, --compile is not applied to pipeline stages, and "
            "--accum is the pipeline's own --microbatches"
        )
    if pp > 1 and run["layers"] < pp:
        raise Usage(f"pp={pp} needs at least {pp} layers")
    cp = sizes.get("cp", 1)
    if cp > 1 and run["seq"] % (2 * cp):
        raise Usage(f"cp={cp}: --seq {run['seq']} must divide into 2 x {cp} chunks (load-balanced context parallel)")
    if cp > 1 and (pp > 1 or args.auto):
        raise Usage(
            "cp: not with pp (untried) nor --auto (untried here: without a cp axis, --auto's search may "
            "choose context parallel on any axis itself)"
        )
    if (args.bf16 or args.zero) and "dp" not in names:
        raise Usage("--bf16 and --zero are data-parallel options: the mesh needs a dp axis")
    if args.steps < 1:
        raise Usage("--steps must be at least 1")
    return run, shape, names


# ------------------------------------------------------------------------------- the pieces
def prepare_data(out: str, run: dict, rank: int):
    """Rank 0 trains the tokenizer and encodes the text once (cached in OUT/data); the others load."""
    data_dir = os.path.join(out, "data")
    cache = os.path.join(data_dir, "tokens.pt")
    if rank == 0 and not os.path.exists(cache):
        files = corpus_files(run["corpus_mb"])
        train, val = corpus_split(files)
        tok = load_or_train_tokenizer(os.path.join(data_dir, "tokenizer.json"), train, run["vocab"])
        blob = {"train": encode(tok, train), "val": encode(tok, val), "files": [os.path.basename(f) for f in files]}
        torch.save(blob, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    blob = torch.load(cache)
    return Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json")), blob


def lr_factor(step: int, run: dict, steps: int) -> float:
    """Linear warm-up to lr over ``warmup`` steps, then cosine decay to min_lr at ``steps``."""
    if step < run["warmup"]:
        return (step + 1) / run["warmup"]
    progress = min(1.0, (step - run["warmup"]) / max(1, steps - run["warmup"]))
    floor = run["min_lr"] / run["lr"]
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build(args, run: dict, shape, names, rank: int):
    """(target, is a pipeline, plan, HF config): target is this rank's module from ap.parallelize,
    or its pipeline runner where the mesh has pp."""
    cfg = llama_config(run["vocab"], run["hidden"], run["layers"], run["heads"], run["kv_heads"], run["seq"])
    torch.manual_seed(run["seed"])
    model = LlamaLM(cfg)
    mesh = ap.Mesh(shape, names)
    # inputs and targets as two tensors (autopar's trace copies one passed twice; before issue 28
    # torch.export made it one input, and the model trained on targets = inputs)
    example = (
        torch.zeros(run["batch"], run["seq"], dtype=torch.long),
        torch.zeros(run["batch"], run["seq"], dtype=torch.long),
    )
    kw = {}
    if "dp" in names and (args.zero or args.bf16):
        kw["data_parallel"] = ap.DataParallel(
            "dp", zero=args.zero or 0, param_dtype=torch.bfloat16 if args.bf16 else None
        )
    elif "dp" in names:
        kw["data_parallel"] = "dp"
    if args.auto:  # the search decides every axis' role; a dp axis with ZeRO or bf16 is its constraint
        kw = kw if args.zero or args.bf16 else {}
    if args.checkpoint:
        kw["activation_checkpoint"] = ap.ActivationCheckpoint(args.checkpoint)
    if "cp" in names:
        kw["context_parallel"] = ap.ContextParallel("cp", method="ring", load_balance=True)
    if args.auto:
        module = ap.parallelize(model, mesh, args=example, auto=True, timeout=args.timeout, **kw)
        return module, False, module.autopar_plan, cfg
    ann = megatron("tp") if "tp" in names else {}
    if "pp" in names:
        pipe = ap.Pipeline("pp", microbatches=args.microbatches or 2 * shape[names.index("pp")])
        plan = ap.plan(model, mesh, args=example, annotations=ann, pipeline=pipe, **kw)
        return plan.pipeline_runner(rank), True, plan, cfg
    module = ap.parallelize(model, mesh, args=example, annotations=ann, timeout=args.timeout, **kw)
    return module, False, module.autopar_plan, cfg


def dp_position(plan, rank: int, pipeline: bool) -> tuple[int, int]:
    """This rank's (dp coordinate, dp size) in the plan (a pipeline runner takes the global batch,
    and so does a context-parallel module: plan.local_inputs cuts rows and sequences)."""
    if pipeline or plan.dp_axis is None or plan.options.context_parallel is not None:
        return 0, 1
    return plan.mesh.coords(rank)[plan.dp_axis], plan.mesh.shape[plan.dp_axis]


def local_call(plan, rank: int, module):
    """``module`` called on this rank's piece of a global batch (plan.local_inputs: with context
    parallel, the head-tail chunks of every sequence)."""

    def call(x, y):
        (lx, ly), _ = plan.local_inputs(rank, x, y)
        return module(lx, ly)

    return call


def make_optimizer(target, run: dict):
    """AdamW through ap.Optimizer (equal to serial on any plan, ZeRO and pipelines included); no
    weight decay on the norms."""
    return ap.Optimizer(
        target,
        torch.optim.AdamW,
        param_groups=[{"params": ["*norm.weight"], "weight_decay": 0.0}],
        lr=run["lr"],
        betas=(0.9, 0.95),
        weight_decay=run["weight_decay"],
    )


# ------------------------------------------------------------------------------ checkpoints
def save_checkpoint(out: str, step: int, target, opt, sched, loader, rank: int) -> str:
    import torch.distributed.checkpoint as dcp

    name = f"step_{step:06d}"
    path = os.path.join(out, "ckpt", name)
    model_sd, optim_sd = ap.get_state_dict(target, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if rank == 0:
        state = {
            "step": step,
            "data": loader.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        }
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump(state, f)
        latest = os.path.join(out, "ckpt", "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(name)
        os.replace(latest + ".tmp", latest)  # only a complete checkpoint is ever named
    dist.barrier()
    return path


def load_checkpoint(out: str, target, opt, sched, loader) -> int:
    import torch.distributed.checkpoint as dcp

    with open(os.path.join(out, "ckpt", "latest")) as f:
        path = os.path.join(out, "ckpt", f.read().strip())
    model_sd, optim_sd = ap.get_state_dict(target, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ap.set_state_dict(target, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    with open(os.path.join(path, "trainer.json")) as f:
        state = json.load(f)
    loader.load_state_dict(state["data"])
    sched.load_state_dict(state["scheduler"])
    rng = torch.frombuffer(bytearray(base64.b64decode(state["rng"])), dtype=torch.uint8)
    torch.set_rng_state(rng)
    return state["step"]


# ---------------------------------------------------------------------------------- reports
class Metrics:
    """OUT/metrics.jsonl (rank 0 appends; every row carries the run number) and OUT/loss.png."""

    def __init__(self, out: str, rank: int):
        self.path, self.png, self.on = os.path.join(out, "metrics.jsonl"), os.path.join(out, "loss.png"), rank == 0
        self.run = 0
        if self.on and os.path.exists(self.path):
            with open(self.path) as f:
                self.run = 1 + max((json.loads(line).get("run", 0) for line in f if line.strip()), default=-1)

    def write(self, row: dict) -> None:
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps({**row, "run": self.run}) + "\n")

    def plot(self, title: str) -> None:
        if not self.on:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train, val, resumed = {}, {}, {}
        with open(self.path) as f:
            for row in map(json.loads, filter(str.strip, f)):
                (val if row.get("kind") == "val" else train)[row["step"]] = row.get("val_loss", row.get("loss"))
                resumed.setdefault(row["run"], row["step"])  # each run's first step
        fig, ax = plt.subplots(figsize=(7, 4))
        for run, step in resumed.items():
            if run:
                ax.axvline(step - 0.5, color="grey", ls=":", label="resumed" if run == 1 else None)
        ax.plot(sorted(train), [train[s] for s in sorted(train)], label="train")
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="validation")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.png, dpi=100)
        plt.close(fig)


def validate(call, val_ids, run: dict, n: int, dp_rank: int, dp_size: int, target) -> float:
    """Mean loss over the first n batches of the validation text (the same batches every time)."""
    loader = TokenLoader(val_ids, run["batch"], run["seq"], dp_rank, dp_size)
    target.eval()
    with torch.no_grad():
        losses = [float(call(*loader.next(), train=False)) for _ in range(n)]
    target.train()
    return sum(losses) / n


def export_and_sample(
    args, out: str, cfg, target, pipeline: bool, tok, val_ids, run, rank: int, ckpt: str, dp, call_module=None
):
    """ap.save_pretrained (a pipeline: its final DCP checkpoint converted), then rank 0 reloads the
    directory with transformers, checks its validation loss, and generates from PROMPT."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    hf_dir = os.path.join(out, "hf")
    if pipeline:  # save_pretrained takes rank modules; a runner's stages go through DCP
        if rank == 0:
            from autopar.checkpoint.convert import dcp_to_hf

            dcp_to_hf(ckpt, hf_dir, LlamaLM(cfg), key="model")
            cfg.save_pretrained(hf_dir)
        dist.barrier()
    else:
        ap.save_pretrained(target, hf_dir)
    x, y = TokenLoader(val_ids, run["batch"], run["seq"], *dp).next()
    target.eval()
    with torch.no_grad():  # every rank: the trained module's loss on the batch transformers gets below
        ours = float(target.evaluate((x, y)) if pipeline else (call_module or target)(x, y))
    if rank != 0:
        return None
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(hf_dir)
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x, y = TokenLoader(val_ids, run["batch"], run["seq"]).next()  # the whole batch
    with torch.no_grad():
        logits = hf(input_ids=x).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
        ids = torch.tensor([tok.encode(PROMPT).ids])
        torch.manual_seed(run["seed"])
        gen = hf.generate(
            ids, max_new_tokens=args.sample_tokens, do_sample=True, temperature=0.8, top_k=40, pad_token_id=0
        )
    text = tok.decode(gen[0].tolist())
    with open(os.path.join(out, "sample.txt"), "w") as f:
        f.write(text)
    return ours, hf_loss, text


# ------------------------------------------------------------------------------------- main
def train(args, run: dict, shape, names) -> None:
    rank, out = dist.get_rank(), args.out
    torch.set_num_threads(1)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        if not args.resume:
            with open(os.path.join(out, "run.json"), "w") as f:
                json.dump({"run": run, "first_command": sys.argv}, f, indent=1)
    tok, blob = prepare_data(out, run, rank)
    target, pipeline, plan, cfg = build(args, run, shape, names, rank)
    dp_rank, dp_size = dp_position(plan, rank, pipeline)
    loader = TokenLoader(blob["train"], run["batch"], run["seq"], dp_rank, dp_size)
    opt = make_optimizer(target, run)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, run, args.steps))
    start = load_checkpoint(out, target, opt, sched, loader) if args.resume else 0
    call_module = torch.compile(target) if args.compile else target
    if plan.options.context_parallel is not None:  # the rank's rows and its pieces of their sequences
        call_module = local_call(plan, rank, call_module)

    def call(x, y, train=True):
        if pipeline:
            return (target.step if train else target.evaluate)((x, y))
        return call_module(x, y)

    metrics = Metrics(out, rank)
    title = f"{os.path.basename(os.path.normpath(out))}: mesh {dict(zip(names, shape))}{' auto' if args.auto else ''}"
    if rank == 0:
        print(
            f"plan: {plan.mesh}, {sum(p.numel() for p in plan.model.parameters()) / 1e6:.2f} M parameters, "
            f"{blob['train'].numel()} training tokens; {'resuming after step ' + str(start) if start else 'from scratch'}",
            flush=True,
        )
    if rank == 0 and args.auto:  # what the search chose, e.g. "automatic plan: dp=R, tp=dp, ZeRO-2 (...)"
        print(plan.explain("auto").splitlines()[0], flush=True)
    tokens_per_step = run["batch"] * run["seq"] * run["accum"]
    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, unit="step", dynamic_ncols=True)
    ckpt = None
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        total = 0.0
        for i in range(run["accum"]):
            x, y = loader.next()
            if pipeline:
                loss = call(x, y)
            else:
                last = i == run["accum"] - 1
                sync = contextlib.nullcontext() if last or not hasattr(target, "no_sync") else target.no_sync()
                with sync:
                    loss = call(x, y)
                    (loss / run["accum"]).backward()
            total += loss.item() / run["accum"]  # .item(): float() of a tensor that requires grad warns
        norm = float(ap.clip_grad_norm_(target, run["clip"]))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        metrics.write(
            {
                "kind": "train",
                "step": step,
                "loss": total,
                "lr": lr,
                "grad_norm": norm,
                "tokens_per_s": tokens_per_step / dt,
                "tokens": step * tokens_per_step,
                "time_s": dt,
            }
        )
        bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
        bar.update(1)
        if step % args.eval_every == 0 or step == args.steps:
            val = validate(call, blob["val"], run, args.eval_batches, dp_rank, dp_size, target)
            metrics.write({"kind": "val", "step": step, "val_loss": val})
            if rank == 0:
                bar.write(f"step {step}: train loss {total:.4f}, validation loss {val:.4f}")
            metrics.plot(title)
        if step % args.ckpt_every == 0 or step == args.steps:
            ckpt = save_checkpoint(out, step, target, opt, sched, loader, rank)
    bar.close()
    if ckpt is None:  # nothing left to train: the last checkpoint is the final one
        with open(os.path.join(out, "ckpt", "latest")) as f:
            ckpt = os.path.join(out, "ckpt", f.read().strip())
    metrics.plot(title)
    dp = (dp_rank, dp_size)
    result = export_and_sample(args, out, cfg, target, pipeline, tok, blob["val"], run, rank, ckpt, dp, call_module)
    if result is not None:
        ours, hf_loss, text = result
        print(
            f"saved {os.path.join(out, 'hf')}; transformers' LlamaForCausalLM reloads it: loss {hf_loss:.5f} "
            f"on the first validation batch (the trained module: {ours:.5f})",
            flush=True,
        )
        print(f"--- sample (sampled, temperature 0.8) ---\n{text}\n---", flush=True)


def fault_tolerant(args, argv) -> int:
    """--fault-tolerant (examples/lm_fault_tolerant.py): this process launches the replica groups,
    or is a rank of one (REPLICA_GROUP_ID set by the launcher)."""
    import lm_fault_tolerant

    sizes = [int(part.partition("=")[2] or 0) for part in (args.mesh or "dp=2").split(",")]
    shape, names = parse_mesh(args.mesh or "dp=2", math.prod(sizes))
    run = run_settings(args, args.out)
    if "dp" not in names or "pp" in names or "cp" in names or args.zero or args.auto or args.resume:
        raise Usage(
            "--fault-tolerant: replica groups on a dp axis, with tp inside (no pp, cp, --zero, --auto, --resume)"
        )
    if "REPLICA_GROUP_ID" not in os.environ:  # the launcher: the data once, then the groups
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        prepare_data(args.out, run, 0)
        dist.destroy_process_group()
        return lm_fault_tolerant.launch(args, list(argv if argv is not None else sys.argv[1:]), shape, names)
    dist.init_process_group("gloo")
    try:
        lm_fault_tolerant.worker(args, run, shape, names, prepare_data(args.out, run, dist.get_rank())[1])
    finally:
        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fault_tolerant:
        try:
            return fault_tolerant(args, argv)
        except Usage as e:
            print(f"train_lm.py: error: {e}", file=sys.stderr, flush=True)
            return 2
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        run, shape, names = check_input(args, world)
    except Usage as e:
        if rank == 0:
            print(f"train_lm.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    if not dist.is_initialized() and "MASTER_ADDR" not in os.environ:  # plain `python train_lm.py`: one rank
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    try:
        train(args, run, shape, names)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
