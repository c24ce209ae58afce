#!/usr/bin/env python
"""Fine-tune GPT-2 on WikiText-2 on Intel Data Center GPU Max (PVC) tiles.

Single node, 4 tiles:
    torchrun --standalone --nproc_per_node=4 01_xpu_gpt2_wikitext.py \
        --output_dir /lus/grand/projects/nlp/gpt2-wt2 --bf16
"""
import argparse
import contextlib
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

import intel_extension_for_pytorch as ipex  # noqa: F401  (registers torch.xpu)
import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("gpt2-wt2")


def parse_args():
    p = argparse.ArgumentParser(description="GPT-2 fine-tuning on XPU")
    p.add_argument("--model_name", default="gpt2")
    p.add_argument("--dataset_config", default="wikitext-2-raw-v1")
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8, help="per-tile micro batch")
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true")
    return p.parse_args()


class BlockDataset(Dataset):
    """Concatenated token stream cut into fixed-size blocks."""

    def __init__(self, ids, block_size):
        n_blocks = len(ids) // block_size
        self.data = torch.tensor(ids[: n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)

    def __len__(self):
        return self.data.size(0)

    def __getitem__(self, idx):
        return self.data[idx]


@contextlib.contextmanager
def main_process_first(rank):
    # rank 0 downloads / tokenizes first, the others then hit the HF cache
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def build_datasets(args, tokenizer, rank):
    with main_process_first(rank):
        raw = load_dataset("wikitext", args.dataset_config)
    out = {}
    for split in ("train", "validation"):
        text = "\n\n".join(t for t in raw[split]["text"] if t.strip())
        ids = tokenizer(text, return_attention_mask=False)["input_ids"]
        out[split] = BlockDataset(ids, args.block_size)
    return out["train"], out["validation"]


@torch.no_grad()
def evaluate(model, loader, device, use_bf16):
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for input_ids in loader:
        input_ids = input_ids.to(device, non_blocking=True)
        with torch.autocast("xpu", dtype=torch.bfloat16, enabled=use_bf16):
            out = model(input_ids=input_ids, labels=input_ids)
        n = input_ids.numel() - input_ids.size(0)  # shifted targets
        total_loss += out.loss.float().item() * n
        total_tokens += n
    model.train()
    return total_loss / max(total_tokens, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    torch.xpu.set_device(local_rank)
    device = torch.device(f"xpu:{local_rank}")
    dist.init_process_group(backend="ccl")

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s][rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds, val_ds = build_datasets(args, tokenizer, rank)
    logger.info("train blocks: %d  val blocks: %d", len(train_ds), len(val_ds))

    train_loader = DataLoader(
        train_ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
    )
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=args.num_workers)

    model = AutoModelForCausalLM.from_pretrained(args.model_name)
    model.to(device)

    no_decay = ("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    model = DDP(model, device_ids=[device])

    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    global_step = 0
    best_ppl = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = 0.0
        for i, input_ids in enumerate(train_loader):
            input_ids = input_ids.to(device, non_blocking=True)
            sync_now = (i + 1) % args.grad_accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("xpu", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = model(input_ids=input_ids, labels=input_ids).loss / args.grad_accum
                loss.backward()
            running += loss.item()
            if not sync_now:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.log_every == 0:
                loss_t = torch.tensor(running / args.log_every, device=device)
                dist.all_reduce(loss_t)
                loss_t /= world_size
                if rank == 0:
                    lr = scheduler.get_last_lr()[0]
                    logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step, loss_t.item(), lr)
                    writer.add_scalar("train/loss", loss_t.item(), global_step)
                    writer.add_scalar("train/lr", lr, global_step)
                running = 0.0

        if rank == 0:
            val_loss = evaluate(model.module, val_loader, device, args.bf16)
            ppl = math.exp(val_loss)
            logger.info("epoch %d done in %.1fs  val_loss %.4f  ppl %.2f", epoch, time.time() - t0, val_loss, ppl)
            writer.add_scalar("val/ppl", ppl, epoch)
            if ppl < best_ppl:
                best_ppl = ppl
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "last"))
        writer.close()
        logger.info("best val ppl %.2f", best_ppl)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
