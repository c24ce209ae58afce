"""
GPT-2 medium pretraining on a pre-tokenized corpus with held-out perplexity tracking.

Keeps `best/` = checkpoint with the lowest validation perplexity, `last/` = most recent.

    torchrun --nnodes=1 --nproc_per_node=8 11_gpt2_medium_ppl_eval.py --config configs/gpt2m.yaml
"""
import argparse
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

DEFAULTS = dict(
    train_bin="data/corpus/train.bin",
    val_bin="data/corpus/val.bin",
    out_dir="runs/gpt2m",
    seq_len=1024,
    micro_batch=8,
    accum=8,
    lr=3e-4,
    min_lr=3e-5,
    warmup=2000,
    max_steps=100000,
    weight_decay=0.1,
    eval_interval=1000,
    num_workers=4,
)


class StridedWindows(Dataset):
    """Non-overlapping seq_len+1 windows over a uint16 token file."""

    def __init__(self, path, seq_len):
        self.path = path
        self.seq_len = seq_len
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = self.data[s:s + self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(chunk[:-1]), torch.from_numpy(chunk[1:])


def lr_schedule(step, c):
    if step < c["warmup"]:
        return c["lr"] * (step + 1) / c["warmup"]
    r = min(1.0, (step - c["warmup"]) / (c["max_steps"] - c["warmup"]))
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1.0 + math.cos(math.pi * r))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    nll, ntok = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                 reduction="sum")
        nll += loss.item()
        ntok += y.numel()
    model.train()
    return nll / ntok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value")
    args = ap.parse_args()
    c = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            c.update(yaml.safe_load(f) or {})
    for kv in args.overrides:
        k, v = kv.split("=", 1)
        c[k] = type(DEFAULTS[k])(v)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_ds = StridedWindows(c["train_bin"], c["seq_len"])
    val_ds = StridedWindows(c["val_bin"], c["seq_len"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=c["micro_batch"], sampler=train_sampler,
                              num_workers=c["num_workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=c["micro_batch"], sampler=val_sampler,
                            num_workers=c["num_workers"], pin_memory=True)

    cfg = GPT2Config(n_positions=c["seq_len"], n_embd=1024, n_layer=24, n_head=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(device)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c["lr"], betas=(0.9, 0.95), fused=True)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    if rank == 0:
        os.makedirs(c["out_dir"], exist_ok=True)
        with open(os.path.join(c["out_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(c, f)

    best_ppl = float("inf")
    step, epoch, micro = 0, 0, 0
    t0 = time.time()
    model.train()
    while step < c["max_steps"]:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            model.require_backward_grad_sync = micro % c["accum"] == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(out.float().view(-1, out.size(-1)), y.view(-1))
            (loss / c["accum"]).backward()
            if micro % c["accum"]:
                continue

            lr = lr_schedule(step, c)
            for g in opt.param_groups:
                g["lr"] = lr
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0 and rank == 0:
                dt = time.time() - t0
                t0 = time.time()
                tps = 20 * c["accum"] * c["micro_batch"] * c["seq_len"] * world / dt
                print(f"step {step:6d} | loss {loss.item():.4f} | lr {lr:.2e} | {tps / 1e3:.1f}k tok/s")

            if step % c["eval_interval"] == 0:
                val_loss = evaluate(model, val_loader, device)
                ppl = math.exp(val_loss)
                if rank == 0:
                    print(f"step {step:6d} | val loss {val_loss:.4f} | val ppl {ppl:.2f}")
                    last = os.path.join(c["out_dir"], "last")
                    model.module.save_pretrained(last)
                    torch.save({"opt": opt.state_dict(), "step": step, "epoch": epoch,
                                "best_ppl": min(best_ppl, ppl)}, os.path.join(last, "train_state.pt"))
                    if ppl < best_ppl:
                        shutil.rmtree(os.path.join(c["out_dir"], "best"), ignore_errors=True)
                        shutil.copytree(last, os.path.join(c["out_dir"], "best"))
                best_ppl = min(best_ppl, ppl)
                dist.barrier()
            if step >= c["max_steps"]:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
