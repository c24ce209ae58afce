"""
Full fine-tuning of gpt2-xl (1.5B) on consumer GPUs with DistributedDataParallel.

Memory savers: bitsandbytes PagedAdamW8bit (optimizer state ~2 bytes/param and paged to host
under pressure), fp16 autocast with GradScaler, HF gradient checkpointing, micro-batches with
gradient accumulation.

    torchrun --nproc_per_node=4 15_ddp_paged_adamw_lm.py --train_file data/stories.txt \
        --output_dir out/gpt2xl-stories
"""
import argparse
import contextlib
import logging
import math
import os
import time

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import GPT2LMHeadModel, GPT2TokenizerFast

log = logging.getLogger(__name__)


class TextBlocks(Dataset):
    def __init__(self, path, tokenizer, block_size):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        ids = tokenizer(text, return_attention_mask=False)["input_ids"]
        n = (len(ids) - 1) // block_size
        self.data = torch.tensor(ids[: n * block_size + 1], dtype=torch.long)
        self.block = block_size
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.block
        return self.data[s : s + self.block]


def parse_args():
    parser = argparse.ArgumentParser(description="gpt2-xl DDP fine-tuning")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--model_name", type=str, default="gpt2-xl")
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--valid_file", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default="out/gpt2xl")
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--per_gpu_batch", type=int, default=2)
    parser.add_argument("--accumulation_steps", type=int, default=16)
    parser.add_argument("--num_epochs", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--fp16", action="store_true", default=True)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def lr_lambda(step, warmup, total):
    if step < warmup:
        return float(step) / max(1, warmup)
    return max(0.0, float(total - step) / max(1, total - warmup))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for x in loader:
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=x, labels=x).loss
        tot[0] += loss.float() * x.size(0)
        tot[1] += x.size(0)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = GPT2TokenizerFast.from_pretrained(args.model_name)
    model = GPT2LMHeadModel.from_pretrained(args.model_name)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    train_ds = TextBlocks(args.train_file, tokenizer, args.block_size)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_gpu_batch, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_loader = None
    if args.valid_file:
        valid_ds = TextBlocks(args.valid_file, tokenizer, args.block_size)
        valid_loader = DataLoader(valid_ds, batch_size=args.per_gpu_batch,
                                  sampler=DistributedSampler(valid_ds, shuffle=False), num_workers=2)

    no_decay = ["bias", "ln_"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = bnb.optim.PagedAdamW8bit(params, lr=args.learning_rate, betas=(0.9, 0.999))
    total_steps = len(train_loader) // args.accumulation_steps * args.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, args.warmup_steps, total_steps))
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    writer = SummaryWriter(os.path.join(args.output_dir, "runs")) if rank == 0 else None
    global_step = 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, x in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            boundary = (i + 1) % args.accumulation_steps == 0
            sync_ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                    loss = model(input_ids=x, labels=x).loss / args.accumulation_steps
                scaler.scale(loss).backward()
            if not boundary:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if rank == 0 and global_step % 20 == 0:
                cur = loss.item() * args.accumulation_steps
                log.info("epoch %d step %d/%d loss %.4f lr %.2e (%.2fs/step)", epoch, global_step, total_steps,
                         cur, scheduler.get_last_lr()[0], (time.time() - t0) / 20)
                writer.add_scalar("train/loss", cur, global_step)
                t0 = time.time()

        if valid_loader is not None:
            vl = evaluate(model, valid_loader, device)
            log.info("epoch %d valid loss %.4f ppl %.2f", epoch, vl, math.exp(vl))
            if writer:
                writer.add_scalar("valid/loss", vl, global_step)

        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch-{epoch}")
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
