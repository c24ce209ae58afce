"""GPT-2 medium continued pretraining with ZeroRedundancyOptimizer (AdamW).

The optimizer step is not overlapped with DDP's backward (overlap_with_ddp=False).

Memory/throughput numbers go to wandb (project zero-sharding).

    torchrun --nproc_per_node=8 zero_wandb.py --data /data/pile_subset --out /shared/runs/gpt2m_zero
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel


class TokenBlocks(Dataset):
    def __init__(self, path, block):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self):
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.tokens[i * self.block:(i + 1) * self.block + 1].astype(np.int64)
        return torch.from_numpy(chunk[:-1]), torch.from_numpy(chunk[1:])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="gpt2-medium")
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--run-name", default=None)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=100):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        tot[0] += torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                    reduction="sum")
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="zero-sharding", name=args.run_name, config={**vars(args), "world_size": world})

    train_set = TokenBlocks(os.path.join(args.data, "train.bin"), args.block)
    val_set = TokenBlocks(os.path.join(args.data, "val.bin"), args.block)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = GPT2LMHeadModel.from_pretrained(args.init).to(device)
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = ZeroRedundancyOptimizer(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        optimizer_class=torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
    )
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * s / total_steps))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    torch.cuda.reset_peak_memory_stats(device)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t_last = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % 20 == 0:
                dt = (time.time() - t_last) / 20
                t_last = time.time()
                wandb.log({
                    "train/loss": loss.item(),
                    "train/grad_norm": gnorm.item(),
                    "train/lr": scheduler.get_last_lr()[0],
                    "perf/step_time": dt,
                    "perf/tokens_per_s": args.batch_size * args.block * world / dt,
                    "mem/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                }, step=step)

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, device)
                wandb.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss)}, step=step)
                optimizer.consolidate_state_dict(to=0)
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.out, f"step{step}"))
                    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                "step": step}, os.path.join(args.out, f"step{step}", "trainer_state.pt"))
                dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
