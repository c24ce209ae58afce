"""Code-completion fine-tune of granite-3b-code-base on a preemptible 8-GPU node.

Saves a single resumable checkpoint (model + optimizer + scheduler + data position)
every N steps and picks up from it automatically after a restart.

    torchrun --nproc_per_node=8 16_granite_preemptible_resume.py --train_npy /shared/tok/train.npy --val_npy /shared/tok/val.npy
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
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ibm-granite/granite-3b-code-base")
    ap.add_argument("--train_npy", required=True)
    ap.add_argument("--val_npy", required=True)
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/granite3b-completion")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max_steps", type=int, default=6000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ckpt_every", type=int, default=250)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class Blocks(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.load(path, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.arr) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        return torch.from_numpy(self.arr[s : s + self.seq_len].astype(np.int64))


class Preemption:
    """SIGTERM from the scheduler -> finish the current step, checkpoint, exit."""

    def __init__(self):
        self.flag = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, *_):
        self.flag = True


def ckpt_path(args):
    return os.path.join(args.ckpt_dir, "latest.pt")


def save_ckpt(args, model, optimizer, scheduler, step, epoch, batches_done):
    os.makedirs(args.ckpt_dir, exist_ok=True)
    tmp = ckpt_path(args) + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "epoch": epoch,
        "batches_done": batches_done,
    }, tmp)
    os.replace(tmp, ckpt_path(args))


@torch.no_grad()
def validate(net, ds, rank, world, device, max_blocks=256):
    net.eval()
    tot = torch.zeros(2, device=device)
    for i in range(rank, min(len(ds), max_blocks), world):
        x = ds[i].unsqueeze(0).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tot[0] += net(input_ids=x, labels=x).loss.float()
        tot[1] += 1
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    preempt = Preemption()

    train_ds, val_ds = Blocks(args.train_npy, args.seq_len), Blocks(args.val_npy, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.max_steps)

    step, epoch, batches_done = 0, 0, 0
    if os.path.exists(ckpt_path(args)):
        ckpt = torch.load(ckpt_path(args))
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, epoch, batches_done = ckpt["step"], ckpt["epoch"], ckpt["batches_done"]
        del ckpt
        if rank == 0:
            print(f"resumed at step {step} (epoch {epoch}, batch {batches_done})", flush=True)

    model = DDP(model, device_ids=[local_rank])

    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, x in enumerate(loader):
            if i < batches_done:
                continue
            x = x.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            model.require_backward_grad_sync = sync
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            (loss / args.accum).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            batches_done = i + 1

            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = validate(model.module, val_ds, rank, world, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

            stop = torch.tensor(int(preempt.flag), device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if step % args.ckpt_every == 0 or stop.item() or step >= args.max_steps:
                if rank == 0:
                    save_ckpt(args, model, optimizer, scheduler, step, epoch, batches_done)
                dist.barrier()
            if stop.item():
                if rank == 0:
                    print(f"preempted, checkpoint at step {step}", flush=True)
                dist.destroy_process_group()
                return
            if step >= args.max_steps:
                break
        epoch += 1
        batches_done = 0

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.ckpt_dir, "final_hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
