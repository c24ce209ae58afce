#!/usr/bin/env python3
"""AVSR training on a shared 4-GPU workstation (no torchrun / slurm), LRS3 subset.

Picks the GPUs with --gpus, finds a free port, and starts one process per GPU with mp.spawn.
A quick greedy-CTC check on 200 dev clips runs on the first process after every epoch.

    python 18_avsr_spawn_workstation.py --gpus 0,1,2,3 --data /scratch/lrs3_small --out runs/av_small
"""
import argparse
import datetime
import functools
import math
import os
import socket
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class AVSet(Dataset):
    def __init__(self, root, split, sp, train):
        self.root, self.sp, self.train = root, sp, train
        with open(os.path.join(root, split + ".tsv")) as f:
            self.rows = [l.rstrip("\n").split("\t") for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, text = self.rows[i]
        v = np.load(os.path.join(self.root, "roi", uid + ".npy"))
        a = np.load(os.path.join(self.root, "fbank", uid + ".npy"))
        o = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, o[0]:o[0] + 88, o[1]:o[1] + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        a = np.pad(a, ((0, max(0, 4 * len(v) - len(a))), (0, 0)))[: 4 * len(v)].astype(np.float32)
        return torch.from_numpy(v), torch.from_numpy(a), torch.tensor(self.sp.encode(text.lower())) + 1, text.lower()


def pad_batch(batch, max_frames):
    batch = [b for b in batch if len(b[0]) <= max_frames] or batch[:1]
    v, a, y, t = zip(*batch)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class AVModel(nn.Module):
    def __init__(self, vocab, d=256):
        super().__init__()
        self.v = nn.Sequential(nn.Conv3d(1, 32, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(32), nn.ReLU(True),
                               nn.Conv3d(32, 64, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
                               nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(128), nn.ReLU(True),
                               nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(256), nn.ReLU(True))
        self.a = nn.Sequential(nn.Conv1d(80, 256, 3, 2, 1), nn.ReLU(True), nn.Conv1d(256, 256, 3, 2, 1), nn.ReLU(True))
        self.inp = nn.Linear(512, d)
        self.pos = nn.Parameter(torch.zeros(1, 1200, d))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 1024, 0.1, batch_first=True), 8)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 1024, 0.1, batch_first=True), 4)
        self.emb = nn.Embedding(vocab, d)
        self.ctc_out, self.out = nn.Linear(d, vocab), nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        h = torch.cat([self.v(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2),
                       self.a(a.transpose(1, 2)).transpose(1, 2)[:, :t]], -1)
        m = torch.arange(t, device=v.device)[None] >= lens[:, None]
        return self.enc(self.inp(h) + self.pos[:, :t], src_key_padding_mask=m), m

    def forward(self, v, a, lens, y, ylens, ctc_w=0.2):
        mem, m = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc_out(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens, zero_infinity=True)
        yi = F.pad(y, (1, 0), value=self.eos)
        yo = F.pad(y, (0, 1))
        yo[torch.arange(len(y)), ylens] = self.eos
        yo = yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)
        L = yi.size(1)
        h = self.dec(self.emb(yi) + self.pos[:, :L], mem, memory_key_padding_mask=m,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        l_att = F.cross_entropy(self.out(h).float().transpose(1, 2), yo, ignore_index=-100, label_smoothing=0.1)
        return ctc_w * l_ctc + (1 - ctc_w) * l_att


def quick_dev_wer(net, ds, sp, device, n=200):
    net.eval()
    err = words = 0
    with torch.no_grad():
        for i in range(min(n, len(ds))):
            v, a, _, ref = ds[i]
            mem, _ = net.encode(v[None].to(device), a[None].to(device), torch.tensor([len(v)], device=device))
            row = torch.unique_consecutive(net.ctc_out(mem)[0].argmax(-1)).tolist()
            hyp = sp.decode([t - 1 for t in row if 0 < t < net.eos])
            err += editdistance.eval(hyp.split(), ref.split())
            words += len(ref.split())
    net.train()
    return err / max(1, words)


def worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=60))
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    sp = spm.SentencePieceProcessor(model_file=cfg["spm"])
    V = sp.get_piece_size() + 2
    train_ds = AVSet(cfg["data"], "train", sp, True)
    dev_ds = AVSet(cfg["data"], "dev", sp, False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, cfg["bs"], sampler=sampler, num_workers=cfg["workers"], pin_memory=True,
                        drop_last=True, collate_fn=functools.partial(pad_batch, max_frames=cfg["max_frames"]))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AVModel(V)).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    accum = cfg["accum"]
    total = cfg["epochs"] * (len(loader) // accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=total + 1, pct_start=0.1)

    ckpt_file = os.path.join(cfg["out"], "last.pt")
    start = 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for it, (v, a, lens, y, ylens, _) in enumerate(loader):
            v, a, lens, y, ylens = (x.to(device, non_blocking=True) for x in (v, a, lens, y, ylens))
            if (it + 1) % accum == 0:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(v, a, lens, y, ylens)
                (loss / accum).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            else:
                # local accumulation, gradients are all-reduced on the next synced backward
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(v, a, lens, y, ylens)
                    (loss / accum).backward()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            wer = quick_dev_wer(model.module, dev_ds, sp, device)
            print(f"epoch {epoch}: dev WER (200 clips) {100 * wer:.2f}%", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="0,1,2,3")
    ap.add_argument("--data", required=True)
    ap.add_argument("--spm", default="spm/unigram500.model")
    ap.add_argument("--out", default="runs/av_small")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-frames", type=int, default=450)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    # must happen before anything touches CUDA in this process
    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    world_size = len(args.gpus.split(","))
    os.makedirs(args.out, exist_ok=True)
    cfg = {k: v for k, v in vars(args).items()}
    mp.spawn(worker, args=(world_size, cfg), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
