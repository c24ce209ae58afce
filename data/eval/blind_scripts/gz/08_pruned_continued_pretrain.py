"""Continued pre-training of a width-pruned Llama (Sheared-LLaMA style recovery).

Loads the pruned HF checkpoint produced by the pruning stage and trains it on a
domain mixture (RedPajama subsets). Validation loss is tracked per domain and
the best checkpoint (lowest average validation perplexity) is kept.

    torchrun --nnodes=1 --nproc_per_node=8 08_pruned_continued_pretrain.py --config configs/recover_2.7b.yaml
"""
import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, get_scheduler

DEFAULTS = {
    "model_path": "ckpt/pruned-llama2-2.7b",
    "data_dir": "data/redpajama_tok",
    "domains": ["arxiv", "book", "c4", "cc", "github", "stackexchange", "wiki"],
    "seq_len": 4096,
    "micro_batch": 2,
    "grad_accum": 8,
    "lr": 1e-4,
    "min_lr_ratio": 0.1,
    "warmup_steps": 500,
    "max_steps": 12000,
    "eval_interval": 500,
    "eval_batches": 25,
    "out_dir": "ckpt/recover-2.7b",
    "seed": 11,
}


class TokenBinDataset(Dataset):
    """Pre-tokenized uint16 .bin shards, cut into fixed-length windows."""

    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = len(self.data) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.data[i * self.seq_len:(i + 1) * self.seq_len].astype(np.int64)
        return torch.from_numpy(x)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))
    return cfg


@torch.no_grad()
def evaluate(model, val_loaders, cfg, device):
    model.eval()
    results = {}
    for dom, loader in val_loaders.items():
        total, n = 0.0, 0
        for j, x in enumerate(loader):
            if j >= cfg["eval_batches"]:
                break
            x = x.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=x, labels=x)
            total += out.loss.item()
            n += 1
        results[dom] = total / max(n, 1)
    model.train()
    return results


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_sets = [TokenBinDataset(os.path.join(cfg["data_dir"], d, "train.bin"), cfg["seq_len"])
                  for d in cfg["domains"]]
    train_ds = torch.utils.data.ConcatDataset(train_sets)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loaders = {}
    for d in cfg["domains"]:
        vds = TokenBinDataset(os.path.join(cfg["data_dir"], d, "val.bin"), cfg["seq_len"])
        val_loaders[d] = DataLoader(vds, batch_size=cfg["micro_batch"],
                                    sampler=DistributedSampler(vds, shuffle=False), num_workers=1)

    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=cfg["warmup_steps"],
                          num_training_steps=cfg["max_steps"],
                          scheduler_specific_kwargs={"min_lr_rate": cfg["min_lr_ratio"]})

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model {n_params / 1e9:.2f}B params, {len(train_ds)} train windows, "
              f"{cfg['micro_batch'] * cfg['grad_accum'] * world * cfg['seq_len'] / 1e6:.2f}M tokens/step",
              flush=True)

    best_ppl = float("inf")
    history = []
    step, epoch, micro = 0, 0, 0
    t0 = time.time()
    model.train()
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            micro += 1
            sync = micro % cfg["grad_accum"] == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if sync:
                    loss = model(input_ids=x, labels=x).loss
                    (loss / cfg["grad_accum"]).backward()
                else:
                    with model.no_sync():
                        loss = model(input_ids=x, labels=x).loss
                        (loss / cfg["grad_accum"]).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 20 == 0:
                tok_s = 20 * cfg["micro_batch"] * cfg["grad_accum"] * world * cfg["seq_len"] / (time.time() - t0)
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} {tok_s:,.0f} tok/s",
                      flush=True)
                t0 = time.time()

            if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
                res = evaluate(model.module, val_loaders, cfg, device)
                avg_ppl = math.exp(sum(res.values()) / len(res))
                if rank == 0:
                    history.append({"step": step, "avg_ppl": avg_ppl, **{k: math.exp(v) for k, v in res.items()}})
                    print(f"[eval] step {step} avg ppl {avg_ppl:.3f} " +
                          " ".join(f"{k}={math.exp(v):.2f}" for k, v in res.items()), flush=True)
                    with open(os.path.join(cfg["out_dir"], "eval_history.json"), "w") as f:
                        json.dump(history, f, indent=1)
                    if avg_ppl < best_ppl:
                        best_ppl = avg_ppl
                        best_dir = os.path.join(cfg["out_dir"], "best")
                        shutil.rmtree(best_dir, ignore_errors=True)
                        model.module.save_pretrained(best_dir, safe_serialization=True)
                        print(f"new best {best_ppl:.3f} at step {step}", flush=True)
                dist.barrier()
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    if rank == 0:
        model.module.save_pretrained(os.path.join(cfg["out_dir"], "last"), safe_serialization=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
