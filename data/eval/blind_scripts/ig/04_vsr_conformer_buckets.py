"""Visual-only speech recognition (lip reading) on LRS3 with length-bucketed batches.

Batches are built from a frame budget instead of a fixed number of clips, so short and long
utterances give similar GPU memory. Every rank draws the same global list of batches and takes
every world_size-th one, which keeps the number of steps per epoch identical on all ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        04_vsr_conformer_buckets.py --config conf/vsr_large.yaml
"""
import argparse
import math
import os
import random
from dataclasses import dataclass, field

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler


@dataclass
class Config:
    train_tsv: str = "data/lrs3/train.tsv"
    valid_tsv: str = "data/lrs3/valid.tsv"
    spm_model: str = "data/lrs3/spm_unigram1000.model"
    exp_dir: str = "exp/vsr_large"
    max_frames_per_batch: int = 1800
    accum_steps: int = 2
    epochs: int = 60
    lr: float = 1e-3
    warmup: int = 5000
    d_model: int = 768
    layers: int = 12
    ctc_weight: float = 0.1
    grad_ckpt: bool = True
    seed: int = 1234
    extra: dict = field(default_factory=dict)


class LipDataset(Dataset):
    def __init__(self, tsv, sp):
        self.rows = []
        with open(tsv) as f:
            root = f.readline().strip()
            for line in f:
                rel, n, text = line.rstrip("\n").split("\t")
                self.rows.append((os.path.join(root, rel), int(n), text))
        self.sp = sp

    def __len__(self):
        return len(self.rows)

    def num_frames(self, i):
        return self.rows[i][1]

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        v = torch.from_numpy(np.load(path)[:, 4:92, 4:92].astype(np.float32) / 255.0)
        v = (v - 0.421) / 0.165
        return v, torch.tensor(self.sp.encode(text.lower())) + 1, text


class DistributedBucketSampler(Sampler):
    def __init__(self, lengths, max_frames, num_replicas, rank, seed=0, shuffle=True):
        self.lengths, self.max_frames = lengths, max_frames
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        batches, cur, cur_max = [], [], 0
        for i in order:
            m = max(cur_max, self.lengths[i])
            if cur and m * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, m = [], self.lengths[i]
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.num_replicas
        return batches[:usable]

    def __iter__(self):
        return iter(self._global_batches()[self.rank::self.num_replicas])

    def __len__(self):
        return len(self._global_batches()) // self.num_replicas


def collate(batch):
    vids, ys, texts = zip(*batch)
    return (nn.utils.rnn.pad_sequence(vids, batch_first=True), torch.tensor([v.size(0) for v in vids]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([y.size(0) for y in ys]), texts)


class VSRModel(nn.Module):
    def __init__(self, vocab, d, layers, grad_ckpt):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                  nn.BatchNorm3d(64), nn.ReLU(inplace=True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.trunk = nn.Sequential(
            nn.Conv2d(64, 128, 3, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, 256, 3, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 512, 3, 2, 1, bias=False), nn.BatchNorm2d(512), nn.ReLU(inplace=True))
        self.proj = nn.Linear(512, d)
        self.pos = nn.Parameter(torch.randn(1, 1024, d) * 0.02)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 12, 4 * d, 0.1, activation="gelu",
                                                                batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.ctc_head = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 12, 4 * d, 0.1, batch_first=True,
                                                                    norm_first=True), 6)
        self.att_head = nn.Linear(d, vocab)
        self.grad_ckpt = grad_ckpt
        self.eos = vocab - 1

    def encode(self, v, lens):
        b, t = v.shape[:2]
        x = self.stem(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        x = self.proj(F.adaptive_avg_pool2d(self.trunk(x), 1).flatten(1)).view(b, t, -1) + self.pos[:, :t]
        pad = torch.arange(t, device=v.device)[None] >= lens[:, None]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, None, pad, use_reentrant=False)
            else:
                x = blk(x, src_key_padding_mask=pad)
        return self.norm(x), pad

    def forward(self, v, lens, ys, ylens, ctc_weight):
        enc, pad = self.encode(v, lens)
        lp = self.ctc_head(enc).float().log_softmax(-1)
        l_ctc = F.ctc_loss(lp.transpose(0, 1), ys, lens, ylens, zero_infinity=True)
        ys_in = F.pad(ys, (1, 0), value=self.eos)
        ys_out = F.pad(ys, (0, 1), value=0)
        ys_out[torch.arange(ys.size(0)), ylens] = self.eos
        ys_out = ys_out.masked_fill(torch.arange(ys_out.size(1), device=ys.device)[None] > ylens[:, None], -100)
        L = ys_in.size(1)
        h = self.dec(self.emb(ys_in) + self.pos[:, :L], enc,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=ys.device),
                     memory_key_padding_mask=pad)
        l_att = F.cross_entropy(self.att_head(h).float().flatten(0, 1), ys_out.flatten(), ignore_index=-100,
                                label_smoothing=0.1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att


@torch.no_grad()
def evaluate(model, ds, sp, device, rank, world):
    model.eval()
    err, tot = 0, 0
    idx = list(range(rank, len(ds), world))
    for s in range(0, len(idx), 16):
        v, lens, _, _, texts = collate([ds[i] for i in idx[s:s + 16]])
        enc, _ = model.encode(v.to(device), lens.to(device))
        best = model.ctc_head(enc).argmax(-1).cpu()
        for b, n, ref in zip(best, lens.tolist(), texts):
            toks = [t - 1 for t in torch.unique_consecutive(b[:n]).tolist() if 0 < t < model.eos]
            hyp = sp.decode(toks).split()
            err += editdistance.eval(hyp, ref.lower().split())
            tot += len(ref.split())
    counts = torch.tensor([err, tot], device=device, dtype=torch.long)
    dist.all_reduce(counts)
    model.train()
    return counts[0].item() / max(1, counts[1].item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = Config()
    a = ap.parse_args()
    if a.config:
        with open(a.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    sp = spm.SentencePieceProcessor(model_file=cfg.spm_model)
    vocab = sp.get_piece_size() + 2
    train_ds, valid_ds = LipDataset(cfg.train_tsv, sp), LipDataset(cfg.valid_tsv, sp)
    bs = DistributedBucketSampler([train_ds.num_frames(i) for i in range(len(train_ds))],
                                  cfg.max_frames_per_batch, world, rank, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_sampler=bs, num_workers=10, collate_fn=collate, pin_memory=True,
                        persistent_workers=True, prefetch_factor=4)

    model = VSRModel(vocab, cfg.d_model, cfg.layers, cfg.grad_ckpt)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.05)
    updates_per_epoch = len(bs) // cfg.accum_steps
    total = cfg.epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt_file = os.path.join(cfg.exp_dir, "checkpoint.pt")
    start = 0
    if os.path.isfile(ckpt_file):
        sd = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        start = sd["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {len(bs)} batches/rank/epoch")

    for epoch in range(start, cfg.epochs):
        bs.set_epoch(epoch)
        ddp.train()
        loss_sum = torch.zeros(2, device=device)
        for i, (v, lens, ys, ylens, _) in enumerate(loader):
            v, lens, ys, ylens = (t.to(device, non_blocking=True) for t in (v, lens, ys, ylens))
            last_micro = (i + 1) % cfg.accum_steps == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if last_micro:
                    loss = ddp(v, lens, ys, ylens, cfg.ctc_weight)
                    (loss / cfg.accum_steps).backward()
                else:
                    with ddp.no_sync():
                        loss = ddp(v, lens, ys, ylens, cfg.ctc_weight)
                        (loss / cfg.accum_steps).backward()
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if last_micro:
                nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} batch {i}/{len(bs)} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
        opt.zero_grad(set_to_none=True)

        dist.all_reduce(loss_sum)
        wer = evaluate(model, valid_ds, sp, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(loss_sum[0] / loss_sum[1]).item():.3f}  valid WER {100 * wer:.2f}")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
