#!/usr/bin/env python3
# Lip reading (VSR) on LRS3 + VoxCeleb2 pseudo-labels.
# ResNet-18 frontend -> conformer encoder -> CTC + transformer decoder.
#
#   torchrun --nnodes 4 --nproc_per_node 8 --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d \
#            --rdzv_endpoint $MASTER:29400 06_vsr_ctc_conformer.py --manifest-dir /shared/manifests
import argparse
import math
import os
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", required=True)
    ap.add_argument("--spm-model", default="/shared/spm/unigram1000.model")
    ap.add_argument("--ckpt-dir", default="/shared/ckpt/vsr_conformer")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--peak-lr", type=float, default=1e-3)
    ap.add_argument("--warmup-epochs", type=int, default=3)
    ap.add_argument("--ctc-weight", type=float, default=0.1)
    ap.add_argument("--wandb-project", default="vsr")
    return ap.parse_args()


class VideoText(Dataset):
    def __init__(self, tsv, sp, train):
        self.rows = [l.rstrip("\n").split("\t") for l in open(tsv)]
        self.sp, self.train = sp, train
        self.aug = torchvision.transforms.RandomCrop(88) if train else torchvision.transforms.CenterCrop(88)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i][0], self.rows[i][-1]
        v = torch.from_numpy(np.load(path)).float().div(255.0)
        v = self.aug(v)
        if self.train and torch.rand(1).item() < 0.5:
            v = v.flip(-1)
        if self.train:
            # time masking, up to 0.4 s per second of video
            t = v.size(0)
            for _ in range(max(1, t // 25)):
                w = int(torch.randint(0, 11, (1,)))
                s = int(torch.randint(0, max(1, t - w), (1,)))
                v[s:s + w] = v.mean()
        v = (v - 0.421) / 0.165
        return v, torch.tensor(self.sp.encode(text.lower()), dtype=torch.long) + 1, text


def collate(batch):
    v, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(v, batch_first=True), torch.tensor([x.size(0) for x in v]),
            torch.cat(y), torch.tensor([x.size(0) for x in y]), t)


class ConvModule(nn.Module):
    def __init__(self, d, k=31):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.norm = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = F.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        y = self.pw2(F.silu(self.norm(self.dw(y))))
        return x + y.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d, heads=8, drop=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(drop), nn.Linear(4 * d, d))
        self.ln_att = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.conv = ConvModule(d)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(drop), nn.Linear(4 * d, d))
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x, pad):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.att(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        x = self.conv(x)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class VSR(nn.Module):
    def __init__(self, vocab, d=512, layers=12):
        super().__init__()
        r18 = torchvision.models.resnet18(weights=None)
        r18.conv1 = nn.Identity()
        r18.maxpool = nn.Identity()
        r18.fc = nn.Identity()
        r18.bn1 = nn.Identity()
        r18.relu = nn.Identity()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64),
                                  nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.trunk = r18
        self.proj = nn.Linear(512, d)
        self.blocks = nn.ModuleList([ConformerBlock(d) for _ in range(layers)])
        self.ctc = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.head = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def forward(self, v, lens, ys, ylens):
        b, t = v.shape[:2]
        x = self.stem(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        x = self.proj(self.trunk(x).view(b, t, -1))
        pad = torch.arange(t, device=x.device)[None] >= lens[:, None]
        for blk in self.blocks:
            x = blk(x, pad)
        logp = self.ctc(x).float().log_softmax(-1)
        l_ctc = F.ctc_loss(logp.transpose(0, 1), ys, lens, ylens, reduction="mean")

        # teacher forcing for the attention decoder
        seqs = torch.split(ys, ylens.tolist())
        ys_in = nn.utils.rnn.pad_sequence([F.pad(s, (1, 0), value=self.eos) for s in seqs], True, self.eos)
        ys_out = nn.utils.rnn.pad_sequence([F.pad(s, (0, 1), value=self.eos) for s in seqs], True, -100)
        L = ys_in.size(1)
        h = self.dec(self.emb(ys_in), x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=x.device),
                     memory_key_padding_mask=pad)
        l_att = F.cross_entropy(self.head(h).float().flatten(0, 1), ys_out.flatten(), ignore_index=-100,
                                label_smoothing=0.1)
        return l_ctc, l_att, logp


def greedy_wer(logp, lens, texts, sp, eos):
    err = tot = 0
    for lp, n, ref in zip(logp.argmax(-1), lens.tolist(), texts):
        ids = [t - 1 for t in torch.unique_consecutive(lp[:n]).tolist() if t not in (0, eos)]
        hyp, ref = sp.decode(ids).split(), ref.lower().split()
        d = np.zeros((len(ref) + 1, len(hyp) + 1), dtype=np.int32)
        d[:, 0], d[0, :] = np.arange(len(ref) + 1), np.arange(len(hyp) + 1)
        for i in range(1, len(ref) + 1):
            for j in range(1, len(hyp) + 1):
                d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]))
        err, tot = err + d[-1, -1], tot + len(ref)
    return err, tot


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    vocab = sp.get_piece_size() + 2
    train_ds = VideoText(os.path.join(args.manifest_dir, "train.tsv"), sp, True)
    valid_ds = VideoText(os.path.join(args.manifest_dir, "valid.tsv"), sp, False)
    train_sampler = DistributedSampler(train_ds, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                          collate_fn=collate, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), 16, num_workers=4, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(VSR(vocab)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=0.03)
    steps_per_epoch = len(train_dl)
    warm = torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=args.warmup_epochs * steps_per_epoch)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, (args.epochs - args.warmup_epochs) * steps_per_epoch)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], [args.warmup_epochs * steps_per_epoch])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args) | {"world_size": world})

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, skipped = time.time(), 0
        for v, lens, ys, ylens, _ in train_dl:
            if (ylens > lens).any():
                skipped += 1
                continue
            v, lens, ys, ylens = v.to(device, non_blocking=True), lens.to(device), ys.to(device), ylens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                l_ctc, l_att, _ = model(v, lens, ys, ylens)
                loss = args.ctc_weight * l_ctc + (1 - args.ctc_weight) * l_att
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"loss": loss.item(), "ctc": l_ctc.item(), "att": l_att.item(), "gnorm": gnorm.item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        model.eval()
        err = tot = 0
        with torch.no_grad():
            for v, lens, ys, ylens, texts in valid_dl:
                v, lens, ys, ylens = v.to(device), lens.to(device), ys.to(device), ylens.to(device)
                _, _, logp = model.module(v, lens, ys, ylens)
                e, n = greedy_wer(logp, lens, texts, sp, vocab - 1)
                err, tot = err + e, tot + n
        counts = torch.tensor([err, tot, skipped], device=device, dtype=torch.float64)
        dist.all_reduce(counts)
        if rank == 0:
            wer = (counts[0] / counts[1]).item()
            wandb.log({"valid_wer": wer, "skipped_batches": counts[2].item(), "epoch_time": time.time() - t0},
                      step=step)
            print(f"epoch {epoch} valid WER {wer:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.ckpt_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
