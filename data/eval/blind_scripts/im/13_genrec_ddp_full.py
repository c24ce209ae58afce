"""
Generative recommender, DDP, gradient accumulation, resumable.

Semantic IDs: the frozen tokenizer's raw codes (codes_raw.npy, num_items x L) are made unique
on rank 0 by appending a collision index, then the table is broadcast to all ranks so every
rank uses exactly the same item -> token mapping.

    torchrun --standalone --nproc_per_node=8 13_genrec_ddp_full.py --data data/beauty --accum 2
    torchrun --standalone --nproc_per_node=8 13_genrec_ddp_full.py --data data/beauty --resume
"""
import argparse
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration, get_cosine_schedule_with_warmup

PAD, EOS, NSPEC = 0, 1, 2


def dedup_codes(raw):
    """Append a collision index; items sharing a prefix get 0, 1, 2, ... in item order."""
    order = np.lexsort(raw.T[::-1])
    suffix = np.zeros(len(raw), dtype=np.int64)
    prev, run = None, 0
    for i in order:
        key = raw[i].tobytes()
        run = run + 1 if key == prev else 0
        suffix[i] = run
        prev = key
    return np.concatenate([raw, suffix[:, None]], 1)


class NextItem(Dataset):
    def __init__(self, seqs, sem, K, split, max_items):
        self.sem, self.K = sem, K
        self.rows = []
        for s in seqs:
            if split == "train":
                self.rows.extend((s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2))
            else:
                self.rows.append((s[-2 - max_items:-2], s[-2]))

    def toks(self, it):
        return [NSPEC + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        return [x for it in h for x in self.toks(it)], self.toks(t) + [EOS]


def collate(b):
    L = max(len(s) for s, _ in b)
    x = torch.full((len(b), L), PAD, dtype=torch.long)
    for i, (s, _) in enumerate(b):
        x[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return x, torch.tensor([t for _, t in b], dtype=torch.long)


@torch.no_grad()
def evaluate(model, loader, device, n_levels, beams):
    net = model.module
    net.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for src, lab in loader:
        src, lab = src.to(device), lab.to(device)
        out = net.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=beams,
                           num_return_sequences=beams, max_new_tokens=n_levels + 1)
        cand = out[:, 1:n_levels + 1].view(src.size(0), beams, n_levels)
        m = (cand == lab[:, None, :n_levels]).all(-1)
        found, rank = m.any(-1), m.float().argmax(-1)
        acc[0] += m[:, :5].any(-1).sum()
        acc[1] += m[:, :10].any(-1).sum()
        acc[2] += (found.double() / torch.log2(rank.double() + 2)).sum()
        acc[3] += src.size(0)
    dist.all_reduce(acc)
    net.train()
    return {"R@5": (acc[0] / acc[3]).item(), "R@10": (acc[1] / acc[3]).item(), "NDCG@10": (acc[2] / acc[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--max_items", type=int, default=20)
    ap.add_argument("--bs", type=int, default=128, help="per-GPU micro batch")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--ckpt_dir", default="ckpt/beauty_genrec")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no_wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    holder = [None]
    if rank == 0:
        raw = np.load(os.path.join(args.data, "codes_raw.npy"))
        sem = dedup_codes(raw)
        assert sem[:, -1].max() < args.K, "collision group larger than codebook"
        holder[0] = sem
        print(f"{len(sem)} items, {len(np.unique(raw, axis=0))} distinct prefixes, max suffix {sem[:, -1].max()}")
    dist.broadcast_object_list(holder, src=0)
    sem = holder[0]
    n_levels = sem.shape[1]

    with open(os.path.join(args.data, "seqs.json")) as f:
        seqs = json.load(f)
    train = NextItem(seqs, sem, args.K, "train", args.max_items)
    valid = NextItem(seqs, sem, args.K, "valid", args.max_items)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(Subset(valid, range(rank, len(valid), world)), batch_size=128, collate_fn=collate,
                          num_workers=2)

    cfg = T5Config(vocab_size=NSPEC + n_levels * args.K, d_model=128, d_ff=1024, d_kv=64, num_layers=4,
                   num_heads=6, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = DDP(T5ForConditionalGeneration(cfg).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.035)
    updates_per_epoch = len(train_dl) // args.accum
    sched = get_cosine_schedule_with_warmup(opt, 10 * updates_per_epoch, args.epochs * updates_per_epoch)

    start, best = 0, 0.0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(last):
        ck = torch.load(last, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        if not args.no_wandb:
            wandb.init(project="genrec", config=vars(args) | {"world_size": world}, resume="allow")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        n_micro = updates_per_epoch * args.accum
        for i, (src, lab) in enumerate(train_dl):
            if i >= n_micro:
                break
            src, lab = src.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                loss = model(input_ids=src, attention_mask=(src != PAD).long(), labels=lab).loss
                (loss / args.accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        metrics = evaluate(model, valid_dl, device, n_levels, args.beams)
        metrics["loss"] = (run[0] / run[1]).item()

        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            if not args.no_wandb:
                wandb.log(metrics, step=epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, metrics["R@10"])}
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            if metrics["R@10"] > best:
                torch.save(state["model"], os.path.join(args.ckpt_dir, "best_model.pt"))
        best = max(best, metrics["R@10"])
        dist.barrier()

    if rank == 0 and not args.no_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
