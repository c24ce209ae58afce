#!/usr/bin/env python3
"""Transformer-base machine translation (de->en), launched through the
torch.distributed.launcher API from this same file.

    python 15_elastic_api_translation.py --nproc 8 --spm data/spm32k.model \
        --train data/train.de-en.tsv --valid data/valid.de-en.tsv --out runs/mt_base

The elastic agent restarts all workers when one fails (--max-restarts), and
every (re)start resumes from <out>/checkpoint_last.pt. Per-rank stdout/stderr:
<out>/agent_logs/.
"""
import argparse
import math
import os
import sys
import time
import uuid

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

PAD, BOS, EOS = 0, 1, 2


def get_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--spm", default="data/spm32k.model")
    p.add_argument("--train", default="data/train.de-en.tsv")
    p.add_argument("--valid", default="data/valid.de-en.tsv")
    p.add_argument("--out", default="runs/mt_base")
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--batch", type=int, default=96, help="sentence pairs per GPU")
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-updates", type=int, default=100000)
    p.add_argument("--save-every", type=int, default=2500)
    return p.parse_args(argv)


class ParallelText(Dataset):
    def __init__(self, path, sp, max_len):
        self.pairs = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                src, tgt = line.rstrip("\n").split("\t")
                s, t = sp.encode(src)[:max_len], sp.encode(tgt)[:max_len - 1]
                self.pairs.append((s, t))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def collate(batch):
    def pad(seqs):
        n = max(len(s) for s in seqs)
        return torch.tensor([s + [PAD] * (n - len(s)) for s in seqs])
    src = pad([s for s, _ in batch])
    tgt_in = pad([[BOS] + t for _, t in batch])
    tgt_out = pad([t + [EOS] for _, t in batch])
    return src, tgt_in, tgt_out


class Seq2Seq(nn.Module):
    def __init__(self, vocab, d=512, heads=8, layers=6, ff=2048, drop=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(1024, d)
        self.tf = nn.Transformer(d, heads, layers, layers, ff, drop, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.scale = math.sqrt(d)

    def embed(self, x):
        return self.emb(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt):
        causal = self.tf.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.tf(self.embed(src), self.embed(tgt), tgt_mask=causal,
                    src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt == PAD,
                    memory_key_padding_mask=src == PAD)
        return self.out(h)


def inverse_sqrt(update, warmup):
    update = max(update, 1)
    return min(update / warmup, math.sqrt(warmup / update))


def train_main(argv):
    args = get_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    train_ds = ParallelText(args.train, sp, args.max_len)
    valid_ds = ParallelText(args.valid, sp, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=128,
                          collate_fn=collate)

    torch.manual_seed(3)
    model = Seq2Seq(sp.get_piece_size()).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    # lr is for 8 GPUs x 96 pairs; keep the same per-pair step size for other sizes
    base_lr = args.lr * (args.batch * world) / (96 * 8)
    update, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "checkpoint_last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        update, epoch = ckpt["update"], ckpt["epoch"]
        if rank == 0:
            print(f"resumed from update {update}", flush=True)
    ddp = DDP(model, device_ids=[local_rank])

    def validate():
        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for src, tin, tout in valid_dl:
                src, tin, tout = src.to(device), tin.to(device), tout.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, tin)
                tot[0] += F.cross_entropy(logits.float().flatten(0, 1), tout.flatten(), ignore_index=PAD,
                                          reduction="sum")
                tot[1] += (tout != PAD).sum()
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item()

    t0 = time.time()
    while update < args.max_updates:
        sampler.set_epoch(epoch)
        for src, tin, tout in train_dl:
            src, tin, tout = (t.to(device, non_blocking=True) for t in (src, tin, tout))
            for g in opt.param_groups:
                g["lr"] = base_lr * inverse_sqrt(update + 1, args.warmup)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(src, tin)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tout.flatten(), ignore_index=PAD,
                                   label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            update += 1
            if rank == 0 and update % 100 == 0:
                print(f"update {update} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                      f"{time.time() - t0:.1f}s", flush=True)
                t0 = time.time()
            if update % args.save_every == 0:
                vloss = validate()
                if rank == 0:
                    print(f"update {update} valid loss {vloss:.3f} ppl {math.exp(vloss):.2f}", flush=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "update": update, "epoch": epoch}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if update >= args.max_updates:
                break
        epoch += 1

    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=f"mt-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=args.max_restarts,
        monitor_interval=5,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(args.out, "agent_logs"), redirects=Std.ALL, tee=Std.NONE),
    )
    try:
        elastic_launch(config, train_main)(sys.argv[1:])
    except Exception as exc:  # ChildFailedError once restarts are exhausted
        print(f"training failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
