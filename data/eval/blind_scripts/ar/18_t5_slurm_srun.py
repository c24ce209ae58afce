#!/usr/bin/env python
"""T5-large span-corruption pretraining on a Slurm cluster, processes started by srun.

Examples are pre-corrupted offline: {train,validation}_inputs.npy int32 [N, 512] and
{train,validation}_targets.npy int32 [N, 114].

    #SBATCH --nodes=8 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=16
    #SBATCH --signal=USR1@180 --requeue
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    srun --kill-on-bad-exit=1 python 18_t5_slurm_srun.py --data /gpfs/t5data/c4_en --ckpt /gpfs/ckpt/t5-large
"""
import argparse
import math
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration

PAD = 0


class Pretokenized(Dataset):
    def __init__(self, root, split):
        self.inputs = np.load(os.path.join(root, f"{split}_inputs.npy"), mmap_mode="r")
        self.targets = np.load(os.path.join(root, f"{split}_targets.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        src = torch.from_numpy(self.inputs[i].astype(np.int64))
        tgt = torch.from_numpy(self.targets[i].astype(np.int64))
        tgt[tgt == PAD] = -100
        return src, tgt


def slurm_init():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, local_rank


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--steps", type=int, default=262144)
    p.add_argument("--save_every", type=int, default=2500)
    p.add_argument("--eval_every", type=int, default=5000)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, device, max_batches=100):
    model.eval()
    agg = torch.zeros(2, device=device, dtype=torch.float64)
    for i, (src, tgt) in enumerate(loader):
        if i == max_batches:
            break
        src, tgt = src.to(device), tgt.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=src, attention_mask=src.ne(PAD), labels=tgt).loss
        n = tgt.ne(-100).sum()
        agg += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1]).item()


def main():
    args = get_args()
    rank, world, local_rank = slurm_init()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    stop = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(flag=True))  # sent by Slurm before the time limit

    torch.manual_seed(0)
    config = T5Config(vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_heads=16,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False,
                      decoder_start_token_id=PAD, pad_token_id=PAD)
    model = T5ForConditionalGeneration(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) / math.sqrt(max(1.0, (s + 1) / args.warmup)))

    train_ds, val_ds = Pretokenized(args.data, "train"), Pretokenized(args.data, "validation")
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch, num_workers=2,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False))

    step, epoch, batches_done = 0, 0, 0
    ckpt_file = os.path.join(args.ckpt, "last.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, epoch, batches_done = ck["step"], ck["epoch"], ck["batches_done"]
        if ck["world"] != world:
            batches_done = batches_done * ck["world"] // world
        del ck
    if is_main:
        os.makedirs(args.ckpt, exist_ok=True)
        print(f"world {world} ({os.environ['SLURM_NNODES']} nodes), start step {step}, epoch {epoch}", flush=True)

    def save():
        if is_main:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "epoch": epoch, "batches_done": batches_done, "world": world},
                       ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    t0 = time.time()
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (src, tgt) in enumerate(loader):
            if i < batches_done:
                continue
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=src, attention_mask=src.ne(PAD), labels=tgt).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            batches_done = i + 1

            if step % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if is_main:
                    dt, t0 = time.time() - t0, time.time()
                    print(f"ep {epoch} step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{50 * args.batch * world / dt:.1f} ex/s", flush=True)
            if step % args.eval_every == 0:
                vl = validate(model, val_loader, device)
                if is_main:
                    print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

            # agree on stopping so every rank leaves the loop at the same step
            flag = torch.tensor([1.0 if stop["flag"] else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if step % args.save_every == 0 or flag.item() > 0:
                save()
            if flag.item() > 0 or step >= args.steps:
                break
        else:
            epoch += 1
            batches_done = 0
            continue
        break

    if is_main:
        model.module.save_pretrained(os.path.join(args.ckpt, f"hf_step{step}"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
