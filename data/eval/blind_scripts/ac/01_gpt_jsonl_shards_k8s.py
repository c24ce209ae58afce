"""Causal LM pretraining (GPT-2 medium sized) on pre-tokenized jsonl shards.

Runs as a Kubeflow PyTorchJob: 1 Master + 3 Worker pods, 8 x A100-80GB each.
The operator injects MASTER_ADDR / MASTER_PORT and RANK (= pod index) into every
pod; the container command is

    torchrun --nnodes=4 --nproc_per_node=8 --node_rank=${RANK} \
        --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} \
        train_gpt_shards.py --data /mnt/datasets/web-tok-v3 --out /mnt/ckpt/gpt-355m

/mnt/datasets and /mnt/ckpt are the same RWX PVC (CephFS) on every pod.
"""
import argparse
import glob
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

EOS_ID = 50256


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--global_bs", type=int, default=512, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=50)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--num_workers", type=int, default=2)
    return p.parse_args()


class TokenStream(IterableDataset):
    """Packs documents from a list of jsonl files into fixed-length sequences."""

    def __init__(self, files, seq_len):
        super().__init__()
        self.files = list(files)
        self.seq_len = seq_len

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        files = self.files
        if info is not None:
            files = files[info.id::info.num_workers]
        buf = []
        for path in files:
            with open(path) as fh:
                for line in fh:
                    buf.extend(json.loads(line)["input_ids"])
                    buf.append(EOS_ID)
                    while len(buf) > self.seq_len:
                        chunk = torch.tensor(buf[: self.seq_len + 1], dtype=torch.long)
                        buf = buf[self.seq_len + 1:]
                        yield chunk[:-1], chunk[1:]


def lm_loss(model, x, y):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


@torch.no_grad()
def evaluate(model, val_files, args, rank, world_size, device):
    model.eval()
    stream = TokenStream(val_files, args.seq_len)
    # every rank takes every world_size-th sequence of the same validation stream
    it = itertools.islice(iter(stream), rank, None, world_size)
    tot = torch.zeros(2, device=device)
    for _ in range(args.eval_batches):
        batch = list(itertools.islice(it, args.micro_bs))
        if not batch:
            break
        x = torch.stack([b[0] for b in batch]).to(device)
        y = torch.stack([b[1] for b in batch]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model, x, y)
        tot[0] += loss * x.size(0)
        tot[1] += x.size(0)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1].clamp(min=1)).item()


def save_checkpoint(path, model, opt, sched, step, epoch):
    tmp = path + ".tmp"
    torch.save(
        {
            "model": model.module.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "step": step,
            "epoch": epoch,
        },
        tmp,
    )
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    assert args.global_bs % (args.micro_bs * world_size) == 0
    grad_accum = args.global_bs // (args.micro_bs * world_size)

    with open(os.path.join(args.data, "meta.json")) as fh:
        meta = json.load(fh)
    files = sorted(glob.glob(os.path.join(args.data, "train-*.jsonl")))
    val_files = sorted(glob.glob(os.path.join(args.data, "val-*.jsonl")))
    my_files = files[rank::world_size]
    tokens_per_step = args.global_bs * args.seq_len
    total_steps = args.epochs * meta["train_tokens"] // tokens_per_step
    if is_main:
        print(f"{len(files)} train shards, world={world_size}, grad_accum={grad_accum}, "
              f"~{total_steps} optimizer steps", flush=True)

    train_ds = TokenStream(my_files, args.seq_len)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(1234)
    cfg = GPT2Config(n_positions=args.seq_len, n_embd=1024, n_layer=24, n_head=16)
    model = GPT2LMHeadModel(cfg).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total_steps)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pt")
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, start_epoch = ckpt["step"], ckpt["epoch"] + 1
        if is_main:
            print(f"resumed from step {step}", flush=True)

    model.train()
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        running = torch.zeros((), device=device)
        for micro, (x, y) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            last_micro = (micro + 1) % grad_accum == 0
            ctx = model.no_sync() if not last_micro else _nullctx()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = lm_loss(model, x, y) / grad_accum
                loss.backward()
            running += loss.detach()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if is_main:
                    dt = time.time() - t0
                    tok_s = args.log_every * tokens_per_step / dt
                    print(f"ep {epoch} step {step}/{total_steps} loss {running.item() / args.log_every:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} tok/s {tok_s:,.0f}", flush=True)
                running.zero_()
                t0 = time.time()

            if step % args.eval_every == 0:
                val = evaluate(model.module, val_files, args, rank, world_size, device)
                if is_main:
                    print(f"step {step} val_loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)

            if step % args.save_every == 0:
                if is_main:
                    save_checkpoint(ckpt_path, model, opt, sched, step, epoch - 1)
                dist.barrier()

        if is_main:
            save_checkpoint(ckpt_path, model, opt, sched, step, epoch)
        dist.barrier()

    if is_main:
        model.module.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
