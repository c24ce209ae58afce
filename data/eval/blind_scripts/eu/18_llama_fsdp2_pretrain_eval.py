"""Small-scale Llama pretraining ablations with FSDP2 (one node).

Each run trains a ~1B model from scratch on a fixed token budget; the ablation
sweep compares held-out loss on a fixed validation slice.

    torchrun --standalone --nproc_per_node=8 18_llama_fsdp2_pretrain_eval.py --run-name abl-wd0.05 --wd 0.05
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--run-name", required=True)
    p.add_argument("--data", default="/scratch/shared/tok/fineweb_llama3")
    p.add_argument("--runs-root", default="/scratch/shared/ablations")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--token-budget", type=float, default=20e9)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=64)
    return p.parse_args()


class Tokens(Dataset):
    def __init__(self, path, seq):
        self.d = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.d) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.d[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


@torch.no_grad()
def evaluate(model, loader, device, n_batches):
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if i >= n_batches:
            break
        logits = model(input_ids=x.to(device)).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    run_dir = os.path.join(args.runs_root, args.run_name)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)

    cfg = LlamaConfig(vocab_size=128256, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3 // 256 * 256),
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, rope_theta=500000.0,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    train = Tokens(os.path.join(args.data, "train.bin"), args.seq)
    val = Tokens(os.path.join(args.data, "val.bin"), args.seq)
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.mbs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=args.mbs, shuffle=False, num_workers=2)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    tokens_per_step = args.mbs * args.seq * world
    total_steps = int(args.token_budget // tokens_per_step)

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / (total_steps - args.warmup))))

    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {total_steps} steps "
              f"({tokens_per_step / 1e6:.1f}M tok/step)", flush=True)

    log = open(os.path.join(run_dir, "metrics.jsonl"), "a") if rank == 0 else None
    step, epoch = 0, 0
    sampler.set_epoch(epoch)
    it = iter(loader)
    model.train()
    t0 = time.time()
    while step < total_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x.to(device, non_blocking=True)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device, non_blocking=True).flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 20 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                el = time.time() - t0
                print(f"step {step}/{total_steps} loss {l.item():.4f} gnorm {gn.item():.3f} lr {lr_at(step):.2e} "
                      f"{20 * tokens_per_step / el / 1e6:.2f}M tok/s", flush=True)
                log.write(json.dumps({"step": step, "train_loss": l.item(), "lr": lr_at(step)}) + "\n")
            t0 = time.time()

        if step % args.eval_every == 0 and rank == 0:
            vl = evaluate(model, val_loader, device, args.eval_batches)
            print(f"[eval] step {step} val_loss {vl:.4f}", flush=True)
            log.write(json.dumps({"step": step, "val_loss": vl}) + "\n")
            log.flush()

        if step % (5 * args.eval_every) == 0 or step == total_steps:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(run_dir, f"step_{step:07d}"))

    if log is not None:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
