"""GPT-2 (124M) from scratch on WikiText-103, restartable DDP training.

    torchrun --nnodes=1 --nproc-per-node=4 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29500 \
        14_gpt2_wikitext_restartable.py --out /nfs/lm/gpt2-wt103
"""
import argparse
import contextlib
import itertools
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, default_data_collator

SIGNALLED = {"term": False}


def _on_term(signum, frame):
    SIGNALLED["term"] = True


@contextlib.contextmanager
def rank_zero_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def build_dataset(tokenizer, block, rank):
    with rank_zero_first(rank):
        raw = load_dataset("wikitext", "wikitext-103-raw-v1")
        tok = raw.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=8, remove_columns=["text"])

        def group(examples):
            concat = {k: list(itertools.chain(*examples[k])) for k in examples}
            total = (len(concat["input_ids"]) // block) * block
            out = {k: [v[i:i + block] for i in range(0, total, block)] for k, v in concat.items()}
            out["labels"] = out["input_ids"].copy()
            return out

        lm = tok.map(group, batched=True, num_proc=8)
    lm.set_format("torch")
    return lm["train"], lm["validation"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=8, help="per GPU; global = bs * 4 GPUs * accum")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--ckpt-steps", type=int, default=500)
    return ap.parse_args()


def main():
    args = parse()
    signal.signal(signal.SIGTERM, _on_term)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = GPT2TokenizerFast.from_pretrained("gpt2")
    train_ds, val_ds = build_dataset(tokenizer, args.block, rank)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4,
                              collate_fn=default_data_collator, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, collate_fn=default_data_collator,
                            sampler=DistributedSampler(val_ds, shuffle=False))

    config = GPT2Config(n_positions=args.block, vocab_size=len(tokenizer))
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates_per_epoch = len(train_loader) // args.accum
    total_updates = updates_per_epoch * args.epochs

    def lr_lambda(u):
        if u < args.warmup:
            return (u + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (u - args.warmup) / max(1, total_updates - args.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    ckpt_file = os.path.join(args.out, "checkpoint.pt")
    start_epoch, start_micro, update = 0, 0, 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, start_micro, update = ck["epoch"], ck["micro_step"], ck["update"]
        if rank == 0:
            print(f"restart: epoch {start_epoch}, micro-step {start_micro}, update {update}", flush=True)

    model = DDP(model, device_ids=[local_rank])

    def save(epoch, micro_step):
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch,
                        "micro_step": micro_step, "update": update}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        halt = False
        for micro_step, batch in enumerate(train_loader):
            if epoch == start_epoch and micro_step < start_micro:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (micro_step + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1

            if rank == 0 and update % 50 == 0:
                print(f"epoch {epoch} update {update}/{total_updates} loss {loss.item() * args.accum:.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / 50:.2f}s/upd", flush=True)
                t0 = time.time()

            term = torch.tensor([SIGNALLED["term"]], dtype=torch.int32, device=device)
            dist.all_reduce(term, op=dist.ReduceOp.MAX)
            halt = bool(term.item())
            if halt or update % args.ckpt_steps == 0:
                save(epoch, micro_step + 1)
            if halt:
                break
        if halt:
            break

        model.eval()
        nll = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(**batch)
                nll += torch.stack([out.loss.float() * batch["input_ids"].size(0),
                                    torch.tensor(float(batch["input_ids"].size(0)), device=device)])
        dist.all_reduce(nll)
        if rank == 0:
            vl = (nll[0] / nll[1]).item()
            print(f"epoch {epoch} val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}", flush=True)
        save(epoch + 1, 0)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
