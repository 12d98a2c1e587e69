"""Checkpoints: memory while loading HF weights into a (2, 2) plan, DCP save/load against serial.

Memory: each of 4 gloo ranks builds a LLaMA-like model on the meta device, plans it on
(dp=2, tp=2) with the Megatron preset, and runs ``ap.load_pretrained`` from a sharded HF
directory. The peak private memory (RssAnon, sampled by a thread) the load adds counts the
rank's pieces (allocated empty before, paged in by the load) and each slice read; the file
pages safetensors maps (page cache, shared, dropped under pressure) are reported apart (VmHWM
after resetting it through /proc/self/clear_refs). Target: about the rank's pieces plus the
largest tensor, not the model. Times and bytes: ``ap.get_state_dict`` + ``dcp.save`` / ``dcp.load`` +
``ap.set_state_dict`` on the 4 ranks (model only), against ``dcp.save``/``dcp.load`` of the
serial model's ``state_dict()`` in one process.

Example:
    >>> rows = run(quick=True)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from bench.common import pool

SLACK = 2 * 2**20  # the interpreter's own first-use allocations during a load (measured ~1.8 MB)
SIZES = {
    "quick": dict(vocab=256, hidden=64, inter=128, layers=1),
    "full": dict(vocab=8192, hidden=512, inter=1408, layers=4),
}


def _config(s):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


class AnonPeak:
    """Peak RssAnon (private memory: not the page cache that safetensors' mmap maps) sampled
    by a thread every ``every`` s while the block runs."""

    def __init__(self, every: float = 2e-4):
        import threading

        self.every, self.peak, self.stop = every, 0, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def now_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))

    def _loop(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now_kb())
            self.stop.wait(self.every)

    def __enter__(self):
        self.base = self.now_kb()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.now_kb())


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rank_job(hf_dir: str, ckpt_dir: str):
    """On every rank: meta model, plan (2, 2), load_pretrained with its memory peak, then DCP times."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, LlamaForCausalLM
    import autopar as ap

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(hf_dir)).eval()
    ids = torch.zeros(4, 16, dtype=torch.long)
    kw = {"input_ids": ids, "labels": ids}
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    module = ap.parallelize(
        model, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False
    )
    shard = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    from safetensors import safe_open  # first-use costs (imports, the index) kept out of the peak
    from autopar.checkpoint.hf import checkpoint_files

    checkpoint_files(hf_dir)
    del safe_open
    dist.barrier()
    ok = _reset_hwm()
    before = _hwm_kb()
    with AnonPeak() as anon:
        ap.load_pretrained(module, hf_dir)
    peak = (anon.peak - anon.base) * 1024
    hwm = (_hwm_kb() - before) * 1024 if ok else None
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(ap.get_state_dict(module)[0], checkpoint_id=ckpt_dir)
    dist.barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sd, _ = ap.get_state_dict(module)
    dcp.load(sd, checkpoint_id=ckpt_dir)
    ap.set_state_dict(module, model_state_dict=sd)
    dist.barrier()
    return {"peak": peak, "hwm": hwm, "shard": shard, "save_s": save_s, "load_s": time.perf_counter() - t0}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _serial(model, path: str):
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.load(model.state_dict(), checkpoint_id=path, no_dist=True)
    return save_s, time.perf_counter() - t0


def run(quick: bool) -> list[dict]:
    import torch
    from transformers import LlamaForCausalLM

    s = SIZES["quick" if quick else "full"]
    tmp = tempfile.mkdtemp(prefix="autopar_ckpt_bench")
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(s))
        hf_dir = os.path.join(tmp, "hf")
        model.save_pretrained(hf_dir, max_shard_size="8MB")
        whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        serial_save, serial_load = _serial(model, os.path.join(tmp, "serial"))
        del model
        res = pool(4).run("bench.bench_checkpoint:rank_job", hf_dir, os.path.join(tmp, "ap"))
        return _rows(
            s,
            res,
            whole,
            largest,
            serial_save,
            serial_load,
            _dir_bytes(os.path.join(tmp, "ap")),
            _dir_bytes(os.path.join(tmp, "serial")),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rows(s, res, whole, largest, serial_save, serial_load, ap_bytes, serial_bytes) -> list[dict]:
    case = f"LLaMA h={s['hidden']} L={s['layers']} V={s['vocab']}, (dp=2, tp=2)"
    mb = 2**20
    peak = max((r["peak"] for r in res if r["peak"] is not None), default=None)
    shard = max(r["shard"] for r in res)
    target = shard + largest + SLACK
    rows = [
        {
            "benchmark": "checkpoint",
            "case": case,
            "metric": "peak private memory added by load_pretrained (MB, max rank)",
            "value": None if peak is None else round(peak / mb, 2),
            "target": f"<= {target / mb:.2f} (shard + largest tensor + 2 MB)",
            "note": (
                f"{'OK' if peak is not None and peak <= target else 'MISS'}: rank shard "
                f"{shard / mb:.2f} MB, largest tensor {largest / mb:.2f} MB, whole model {whole / mb:.2f} MB; "
                f"per rank {[round(r['peak'] / mb, 2) for r in res]}; with the safetensors pages mapped "
                f"(VmHWM) {[None if r['hwm'] is None else round(r['hwm'] / mb, 2) for r in res]}"
            ),
        }
    ]
    save, load = max(r["save_s"] for r in res), max(r["load_s"] for r in res)
    rows.append(
        {
            "benchmark": "checkpoint",
            "case": case,
            "metric": "DCP save s (ap 4 ranks / serial 1 process)",
            "value": round(save, 3),
            "target": "",
            "note": f"serial dcp.save {serial_save:.3f} s",
        }
    )
    rows.append(
        {
            "benchmark": "checkpoint",
            "case": case,
            "metric": "DCP load s (ap 4 ranks / serial 1 process)",
            "value": round(load, 3),
            "target": "",
            "note": f"serial dcp.load {serial_load:.3f} s; ap includes get_state_dict and set_state_dict",
        }
    )
    rows.append(
        {
            "benchmark": "checkpoint",
            "case": case,
            "metric": "bytes on disk (ap / serial)",
            "value": round(ap_bytes / serial_bytes, 3),
            "target": "~1.0",
            "note": f"ap {ap_bytes / mb:.2f} MB, serial {serial_bytes / mb:.2f} MB (replicas written once)",
        }
    )
    return rows
