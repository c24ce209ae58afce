"""Nucleotide-Transformer style MLM pretraining on multi-species genomes (non-overlapping 6-mers).

The genomes were chunked offline into 6 kb windows and tokenised to a uint16 memmap
(`tokens.u16`, shape [N, 1000]) by prepare_kmers.py. Long runs are preempted, so
training resumes from --resume when given.

    torchrun --nproc_per_node=8 10_nt_kmer_pretrain.py --data /shared/nt_multispecies \
        --out /shared/runs/nt_500m --resume /shared/runs/nt_500m/latest.pt
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import EsmConfig, EsmForMaskedLM

# vocab layout written by prepare_kmers.py: 0 <unk> 1 <pad> 2 <mask> 3 <cls> 4 <eos> 5.. 4096 6-mers, then N-containing
SPECIAL = {"unk": 0, "pad": 1, "mask": 2, "cls": 3, "eos": 4}


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=16000)
    ap.add_argument("--max_steps", type=int, default=300000)
    ap.add_argument("--ckpt_every", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    return ap.parse_args()


class KmerWindows(Dataset):
    def __init__(self, root, split):
        meta = json.load(open(os.path.join(root, "meta.json")))
        self.vocab_size = meta["vocab_size"]
        n, L = meta[split]["n"], meta["window_tokens"]
        self.arr = np.memmap(os.path.join(root, f"{split}.u16"), dtype=np.uint16, mode="r", shape=(n, L))

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        x = torch.from_numpy(self.arr[i].astype(np.int64))
        return torch.cat([torch.tensor([SPECIAL["cls"]]), x])


def mlm_mask(ids, vocab_size, p=0.15):
    labels = ids.clone()
    maskable = ids > SPECIAL["eos"]
    sel = (torch.rand(ids.shape, device=ids.device) < p) & maskable
    labels[~sel] = -100
    r = torch.rand(ids.shape, device=ids.device)
    ids = ids.clone()
    ids[sel & (r < 0.8)] = SPECIAL["mask"]
    swap = sel & (r >= 0.8) & (r < 0.9)
    ids[swap] = torch.randint(5, vocab_size, (int(swap.sum()),), device=ids.device)
    return ids, labels


def lr_lambda(warmup):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return (warmup / (step + 1)) ** 0.5  # inverse square root, as in the NT paper
    return f


@torch.no_grad()
def validate(model, loader, device, vocab_size, n_batches=50):
    model.eval()
    g = torch.Generator(device=device).manual_seed(0)
    s = torch.zeros(2, device=device)
    for b, ids in enumerate(loader):
        if b == n_batches:
            break
        ids = ids.to(device)
        sel = (torch.rand(ids.shape, device=device, generator=g) < 0.15) & (ids > SPECIAL["eos"])
        inp = ids.masked_fill(sel, SPECIAL["mask"])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inp, attention_mask=torch.ones_like(inp)).logits
        s[0] += F.cross_entropy(logits[sel].float(), ids[sel], reduction="sum")
        s[1] += sel.sum()
    dist.all_reduce(s)
    model.train()
    return math.exp((s[0] / s[1]).item())


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = KmerWindows(args.data, "train"), KmerWindows(args.data, "valid")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    cfg = EsmConfig(vocab_size=train_ds.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                    max_position_embeddings=1026, position_embedding_type="rotary", pad_token_id=SPECIAL["pad"],
                    mask_token_id=SPECIAL["mask"], token_dropout=False, emb_layer_norm_before=False)
    model = EsmForMaskedLM(cfg).to(device)
    model.esm.contact_head.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup))

    step, epoch, skip = 0, 0, 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, epoch, skip = ckpt["step"], ckpt["epoch"], ckpt["batches_in_epoch"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
        del ckpt
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for b, ids in enumerate(loader):
            if b < skip * args.accum:
                continue
            ids = ids.to(device, non_blocking=True)
            inp, labels = mlm_mask(ids, train_ds.vocab_size)
            last = (b + 1) % args.accum == 0
            with (model.no_sync() if not last else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=inp, attention_mask=torch.ones_like(inp), labels=labels).loss
                (loss / args.accum).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{100 / (time.time() - t0):.2f} step/s", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                ppl = validate(model, val_loader, device, train_ds.vocab_size)
                if rank == 0:
                    print(f"step {step} valid ppl {ppl:.3f}", flush=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "sched": sched.state_dict(), "step": step, "epoch": epoch,
                             "batches_in_epoch": (b + 1) // args.accum}
                    tmp = os.path.join(args.out, "latest.pt.tmp")
                    torch.save(state, tmp)
                    os.replace(tmp, os.path.join(args.out, "latest.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        skip = 0
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
