"""Autoregressive protein LM (ProGen-like, GPT-2 backbone) trained on UniRef90 parquet shards.

Sequences are wrapped as "1" + seq + "2" (N->C) and, with p=0.5, reversed as "2" + rev + "1",
following the ProGen2 convention so the model can generate in both directions.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        06_progen_causal_ppl.py --data /shared/uniref90_parquet --out /shared/runs/progen_small
"""
import argparse
import glob
import math
import os
import random
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

AA = "ACDEFGHIKLMNPQRSTVWYXBZUO"
VOCAB = ["<pad>", "1", "2"] + list(AA)
STOI = {c: i for i, c in enumerate(VOCAB)}
PAD_ID = 0


def encode(seq, reverse=False):
    seq = "".join(c if c in STOI else "X" for c in seq)
    s = "2" + seq[::-1] + "1" if reverse else "1" + seq + "2"
    return [STOI[c] for c in s]


class ParquetProteins(Dataset):
    def __init__(self, files, max_len, train=True):
        self.seqs = []
        for f in files:
            self.seqs.extend(pq.read_table(f, columns=["sequence"]).column("sequence").to_pylist())
        self.max_len = max_len
        self.train = train

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        ids = encode(s, reverse=self.train and random.random() < 0.5)
        if len(ids) > self.max_len:
            start = random.randint(0, len(ids) - self.max_len) if self.train else 0
            ids = ids[start:start + self.max_len]
        return torch.tensor(ids, dtype=torch.long)


def pad_collate(batch):
    L = max(len(x) for x in batch)
    out = torch.full((len(batch), L), PAD_ID, dtype=torch.long)
    for i, x in enumerate(batch):
        out[i, : len(x)] = x
    return out


def lm_loss(model, ids):
    attn = (ids != PAD_ID).long()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    tgt = ids[:, 1:].masked_fill(ids[:, 1:] == PAD_ID, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, (tgt != -100).sum()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=None):
    model.eval()
    total_nll, total_tok = 0.0, 0
    for b, ids in enumerate(loader):
        if max_batches and b >= max_batches:
            break
        ids = ids.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            nll, n = lm_loss(model, ids)
        total_nll += nll.item()
        total_tok += n.item()
    stats = torch.tensor([total_nll, total_tok], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return math.exp(stats[0].item() / stats[1].item())


def cosine_lr(step, base_lr, warmup, total, min_ratio=0.1):
    if step < warmup:
        return base_lr * step / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--max_steps", type=int, default=200000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_embd", type=int, default=768)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
    valid_files, train_files = files[:1], files[1:]
    train_ds = ParquetProteins(train_files, args.max_len, train=True)
    valid_ds = ParquetProteins(valid_files, args.max_len, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=pad_collate, num_workers=8, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size,
                              sampler=DistributedSampler(valid_ds, shuffle=False),
                              collate_fn=pad_collate, num_workers=4, pin_memory=True)

    cfg = GPT2Config(vocab_size=len(VOCAB), n_positions=args.max_len, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_embd // 64, bos_token_id=STOI["1"],
                     eos_token_id=STOI["2"], pad_token_id=PAD_ID)
    model = GPT2LMHeadModel(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.1f}M params, {len(train_ds)} train seqs, world {world}", flush=True)

    step, micro, epoch = 0, 0, 0
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for ids in train_loader:
            ids = ids.to(device, non_blocking=True)
            sync = (micro + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    nll, n = lm_loss(model, ids)
                loss = nll / n.clamp(min=1)
                (loss / args.grad_accum).backward()
            micro += 1
            if not sync:
                continue
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, args.lr, args.warmup, args.max_steps)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 100 == 0:
                tps = 100 * args.grad_accum * args.batch_size * world / (time.time() - t0)
                print(f"step {step} loss {loss.item():.4f} {tps:.0f} seq/s", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                ppl = evaluate(model, valid_loader, device, max_batches=200)
                if rank == 0:
                    print(f"step {step} valid ppl {ppl:.3f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                                "config": cfg.to_dict()}, os.path.join(args.out, "last.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
