"""Class-conditional image-token GPT trained with gradient accumulation, started with mp.spawn
(single node; our workstation queue does not provide torchrun).

    python 12_gpt_spawn_accum.py --gpus 4 --codes /scratch/tok/imagenet_vq16_256 --out runs/gpt_accum
"""
import argparse
import math
import os
import socket
from contextlib import closing, nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image

from lab_tokenizers.vqgan import load_vqgan


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def merge_shards(code_dir):
    """Concatenate tokenize_imagenet.py shards into one memory-mappable file (done once)."""
    out = os.path.join(code_dir, "all_codes.npy")
    if not os.path.exists(out):
        shards = sorted(f for f in os.listdir(code_dir) if f.startswith("shard_") and f.endswith(".npz"))
        parts = [np.load(os.path.join(code_dir, f)) for f in shards]
        codes = np.concatenate([p["codes"] for p in parts]).astype(np.int16)
        labels = np.concatenate([p["labels"] for p in parts]).astype(np.int16)
        np.save(out + ".tmp.npy", codes)
        np.save(os.path.join(code_dir, "all_labels.npy"), labels)
        os.replace(out + ".tmp.npy", out)
    return out


class Codes(Dataset):
    def __init__(self, code_dir):
        self.codes = np.load(os.path.join(code_dir, "all_codes.npy"), mmap_mode="r")
        self.labels = np.load(os.path.join(code_dir, "all_labels.npy"))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.codes[i].astype(np.int64)), int(self.labels[i])


class GPT(nn.Module):
    def __init__(self, vocab=16384, n_cls=1000, seq=256, d=1024, L=16, H=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.cls = nn.Embedding(n_cls, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(d, H, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.tr = nn.TransformerEncoder(layer, L)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.seq = seq
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, codes, y):
        x = torch.cat([self.cls(y)[:, None], self.tok(codes[:, :-1])], 1) + self.pos[:, : codes.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.ln(self.tr(x, mask=causal, is_causal=True)))

    @torch.no_grad()
    def sample(self, y, top_k=600, temperature=1.0):
        codes = torch.zeros(y.shape[0], 0, dtype=torch.long, device=y.device)
        for _ in range(self.seq):
            logits = self(torch.cat([codes, codes.new_zeros(y.shape[0], 1)], 1), y)[:, -1] / temperature
            v, _ = logits.topk(top_k)
            logits[logits < v[:, -1:]] = -float("inf")
            codes = torch.cat([codes, torch.multinomial(logits.softmax(-1), 1)], 1)
        return codes


def worker(rank, world, args, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        merge_shards(args.codes)
    dist.barrier()
    ds = Codes(args.codes)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    model = GPT().to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)

    global_bs = args.micro_bs * args.accum * world
    steps_per_epoch = len(dl) // args.accum
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    if rank == 0:
        print(f"world {world} global batch {global_bs} optimizer steps {total}", flush=True)

    start_epoch = 0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc_loss = torch.zeros((), device=device)
        n_micro = steps_per_epoch * args.accum
        for i, (codes, y) in enumerate(dl):
            if i >= n_micro:
                break
            codes, y = codes.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(codes, y)
                loss = F.cross_entropy(logits.float().flatten(0, 1), codes.flatten()) / args.accum
                loss.backward()
            acc_loss += loss.detach()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} loss {acc_loss.item() / steps_per_epoch:.4f} lr {sched.get_last_lr()[0]:.2e}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
            if (epoch + 1) % args.sample_every == 0:
                vq = load_vqgan(args.vqgan).to(device).eval()
                model.eval()
                y = torch.arange(0, 1000, 125, device=device)
                imgs = vq.decode_indices(model.module.sample(y).view(-1, 16, 16))
                save_image(imgs * 0.5 + 0.5, os.path.join(args.out, f"samples_{epoch:03d}.png"), nrow=8)
                del vq
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--codes", required=True)
    ap.add_argument("--vqgan", default="ckpt/vqgan_f16_16384.ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--sample_every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mp.spawn(worker, args=(args.gpus, args, free_port()), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
