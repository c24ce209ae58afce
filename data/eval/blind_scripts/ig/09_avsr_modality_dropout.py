#!/usr/bin/env python3
"""Robust AVSR on LRS3: modality dropout + hybrid CTC/attention decoding.

During training a whole modality branch is skipped for some steps (video-only / audio-only steps),
so the model stays usable when one stream is missing or corrupted at test time. The branch choice
is drawn from a generator seeded the same on every rank, so all ranks skip the same branch in the
same step.

Decoding: attention beam search, n-best rescored with the CTC score (lambda = ctc weight).

    torchrun --nproc_per_node=8 09_avsr_modality_dropout.py --data-dir /data/lrs3_prep --spm spm/bpe1k.model
"""
import argparse
import math
import os

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class AVData(Dataset):
    def __init__(self, data_dir, split, sp, train):
        with open(os.path.join(data_dir, f"{split}.tsv")) as f:
            self.rows = [l.rstrip("\n").split("\t") for l in f]
        self.dir, self.sp, self.train = data_dir, sp, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, text = self.rows[i][0], self.rows[i][-1]
        v = np.load(os.path.join(self.dir, "video", uid + ".npy"))
        a = np.load(os.path.join(self.dir, "fbank", uid + ".npy"))
        o = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, o[0]:o[0] + 88, o[1]:o[1] + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        a = np.pad(a, ((0, max(0, 4 * len(v) - len(a))), (0, 0)))[: 4 * len(v)]
        return torch.from_numpy(v), torch.from_numpy(a).float(), torch.tensor(self.sp.encode(text)) + 1, text


def collate(batch):
    v, a, y, t = zip(*batch)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class Branch(nn.Module):
    def __init__(self, kind, d):
        super().__init__()
        self.kind = kind
        if kind == "video":
            self.net = nn.Sequential(
                nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
                nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
                nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(128), nn.ReLU(True),
                nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(256), nn.ReLU(True),
                nn.Conv3d(256, 512, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(512), nn.ReLU(True))
            self.proj = nn.Linear(512, d)
        else:
            self.net = nn.Sequential(nn.Conv1d(80, 256, 3, 2, 1), nn.BatchNorm1d(256), nn.ReLU(True),
                                     nn.Conv1d(256, 512, 3, 2, 1), nn.BatchNorm1d(512), nn.ReLU(True))
            self.proj = nn.Linear(512, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 4 * d, 0.1, batch_first=True), 6)

    def forward(self, x, t, pad):
        if self.kind == "video":
            h = self.net(x.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        else:
            h = self.net(x.transpose(1, 2)).transpose(1, 2)[:, :t]
        return self.enc(self.proj(h), src_key_padding_mask=pad)


class RobustAVSR(nn.Module):
    def __init__(self, vocab, d=512):
        super().__init__()
        self.d = d
        self.video = Branch("video", d)
        self.audio = Branch("audio", d)
        self.fusion = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 6)
        self.mix = nn.Linear(2 * d, d)
        self.ctc_out = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(1500, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 6)
        self.att_out = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens, drop=None):
        t = v.size(1)
        pad = torch.arange(t, device=v.device)[None] >= lens[:, None]
        zeros = v.new_zeros(v.size(0), t, self.d)
        hv = zeros if drop == "video" else self.video(v, t, pad)
        ha = zeros if drop == "audio" else self.audio(a, t, pad)
        x = self.mix(torch.cat([hv, ha], -1)) + self.pos(torch.arange(t, device=v.device))
        return self.fusion(x, src_key_padding_mask=pad), pad

    def decoder_logp(self, ys, mem, pad):
        L = ys.size(1)
        h = self.dec(self.emb(ys) + self.pos(torch.arange(L, device=ys.device)), mem,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=ys.device),
                     memory_key_padding_mask=pad)
        return self.att_out(h).float().log_softmax(-1)

    def forward(self, v, a, lens, ys, ylens, drop=None, ctc_weight=0.1):
        mem, pad = self.encode(v, a, lens, drop)
        l_ctc = F.ctc_loss(self.ctc_out(mem).float().log_softmax(-1).transpose(0, 1), ys, lens, ylens,
                           zero_infinity=True)
        ys_in = F.pad(ys, (1, 0), value=self.eos)
        tgt = F.pad(ys, (0, 1), value=0)
        tgt[torch.arange(len(ys)), ylens] = self.eos
        tgt = tgt.masked_fill(torch.arange(tgt.size(1), device=ys.device)[None] > ylens[:, None], -100)
        lp = self.decoder_logp(ys_in, mem, pad)
        l_att = F.nll_loss(lp.flatten(0, 1), tgt.flatten(), ignore_index=-100)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att

    @torch.no_grad()
    def recognize(self, v, a, beam=8, ctc_weight=0.3, max_len=120, drop=None):
        lens = torch.tensor([v.size(1)], device=v.device)
        mem, pad = self.encode(v, a, lens, drop)
        ctc_lp = self.ctc_out(mem).float().log_softmax(-1)
        beams, done = [([self.eos], 0.0)], []
        for _ in range(max_len):
            ys = torch.tensor([b[0] for b in beams], device=v.device)
            lp = self.decoder_logp(ys, mem.expand(len(beams), -1, -1), pad.expand(len(beams), -1))[:, -1]
            cand = []
            for (seq, s), row in zip(beams, lp):
                val, idx = row.topk(beam)
                cand += [(seq + [k], s + x) for x, k in zip(val.tolist(), idx.tolist())]
            cand.sort(key=lambda c: -c[1])
            beams = []
            for seq, s in cand[:beam]:
                (done if seq[-1] == self.eos else beams).append((seq, s))
            if not beams:
                break
        done = done or beams
        rescored = []
        for seq, s in done:
            toks = [t for t in seq[1:] if t != self.eos]
            if not toks or len(toks) > v.size(1):
                continue
            tgt = torch.tensor([toks], device=v.device)
            ctc_score = -F.ctc_loss(ctc_lp.transpose(0, 1), tgt, lens, torch.tensor([len(toks)], device=v.device),
                                    reduction="sum")
            rescored.append((toks, (1 - ctc_weight) * s + ctc_weight * ctc_score.item()))
        return max(rescored, key=lambda r: r[1])[0] if rescored else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--spm", required=True)
    ap.add_argument("--out", default="exp/robust_avsr")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--p-drop-video", type=float, default=0.25)
    ap.add_argument("--p-drop-audio", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    V = sp.get_piece_size() + 2
    train_ds, test_ds = AVData(args.data_dir, "train", sp, True), AVData(args.data_dir, "test", sp, False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, collate_fn=collate, pin_memory=True,
                    drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(RobustAVSR(V)).to(dev)
    # whole branches are skipped on modality-dropout steps
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.03)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total, pct_start=0.1)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    drop_gen = torch.Generator().manual_seed(args.seed + 1000 * start)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="robust-avsr", config=vars(args), resume="allow")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (v, a, lens, ys, ylens, _) in enumerate(dl):
            r = torch.rand(1, generator=drop_gen).item()
            drop = "video" if r < args.p_drop_video else ("audio" if r < args.p_drop_video + args.p_drop_audio else None)
            v, a, lens, ys, ylens = (x.to(dev, non_blocking=True) for x in (v, a, lens, ys, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, ys, ylens, drop=drop)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"loss": loss.item(), "lr": sched.get_last_lr()[0], "drop": str(drop), "epoch": epoch})

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"ep{epoch:02d}.pt"))

        if (epoch + 1) % 5 == 0 or epoch == args.epochs - 1:
            net = model.module
            net.eval()
            counts = torch.zeros(3, 2, dtype=torch.long, device=dev)  # [av, v-only, a-only] x [err, words]
            lines = []
            for i in range(rank, len(test_ds), world):
                v, a, y, text = test_ds[i]
                v, a = v[None].to(dev), a[None].to(dev)
                ref = text.split()
                for m, drop in enumerate([None, "audio", "video"]):
                    hyp = sp.decode([t - 1 for t in net.recognize(v, a, drop=drop)])
                    counts[m, 0] += editdistance.eval(hyp.split(), ref)
                    counts[m, 1] += len(ref)
                    if drop is None:
                        lines.append(f"{test_ds.rows[i][0]}\t{hyp}")
            dist.all_reduce(counts)
            all_lines = [None] * world
            dist.all_gather_object(all_lines, lines)
            if rank == 0:
                wers = (counts[:, 0].double() / counts[:, 1].double()).tolist()
                wandb.log({"test/wer_av": wers[0], "test/wer_v": wers[1], "test/wer_a": wers[2], "epoch": epoch})
                print(f"epoch {epoch}: WER AV {wers[0]:.3f}  V {wers[1]:.3f}  A {wers[2]:.3f}", flush=True)
                with open(os.path.join(args.out, f"hyp_ep{epoch:02d}.txt"), "w") as f:
                    f.write("\n".join(sorted(l for part in all_lines for l in part)) + "\n")
            model.train()
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
