#!/usr/bin/env python3
# Joint CTC/attention transformer ASR (LibriSpeech 960h, BPE 5000).
# Dev WER with beam search after every epoch picks the checkpoint.
#
#   torchrun --nproc_per_node=8 14_joint_ctc_attn_beam_dev.py --train data/train_960.tsv \
#       --dev data/dev_clean.tsv data/dev_other.tsv --bpe data/bpe5000.model --exp exp/tfm_joint
import argparse
import math
import os
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", nargs="+", required=True)
    p.add_argument("--bpe", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=25000)
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--max-frames", type=int, default=3000)
    return p.parse_args()


class UttDataset(Dataset):
    def __init__(self, tsvs, sp, max_frames=None):
        self.rows = []
        for tsv in tsvs:
            for line in open(tsv):
                uid, path, n, text = line.rstrip("\n").split("\t", 3)
                if max_frames is None or int(n) <= max_frames:
                    self.rows.append((uid, path, text))
        self.sp = sp

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, path, text = self.rows[i]
        return torch.from_numpy(np.load(path)).float(), torch.tensor(self.sp.encode(text)), text


def collate(batch):
    xs, ys, texts = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            list(ys), list(texts))


class JointCTCAttention(nn.Module):
    def __init__(self, vocab, d=256, heads=4, elayers=12, dlayers=6, ff=2048, drop=0.1):
        super().__init__()
        self.sos = self.eos = vocab  # extra symbol
        self.blank = 0
        self.odim = vocab + 1
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.sub_out = nn.Linear(d * 19, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, drop, batch_first=True), elayers)
        self.ctc_lo = nn.Linear(d, self.odim)
        self.dec_emb = nn.Embedding(self.odim, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, ff, drop, batch_first=True), dlayers)
        self.dec_out = nn.Linear(d, self.odim)
        self.d = d

    def pe(self, T, device):
        pos = torch.arange(T, device=device).float()[:, None]
        div = torch.exp(torch.arange(0, self.d, 2, device=device).float() * (-math.log(1e4) / self.d))
        out = torch.zeros(T, self.d, device=device)
        out[:, 0::2], out[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        return out

    def encode(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.sub_out(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        x = x * math.sqrt(self.d) + self.pe(t, x.device)
        mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        return self.encoder(x, src_key_padding_mask=mask), lens, mask

    def decode(self, ys_in, mem, mem_mask):
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ys_in.device), 1)
        h = self.dec_emb(ys_in) * math.sqrt(self.d) + self.pe(L, ys_in.device)
        return self.dec_out(self.decoder(h, mem, tgt_mask=causal, memory_key_padding_mask=mem_mask))

    def forward(self, x, lens, ys, ctc_weight):
        mem, hlens, mask = self.encode(x, lens)
        dev = x.device
        ys_pad = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-1).to(dev)
        ylens = torch.tensor([len(y) for y in ys], device=dev)
        ctc_lp = self.ctc_lo(mem).log_softmax(-1).transpose(0, 1)
        l_ctc = F.ctc_loss(ctc_lp, ys_pad.clamp(min=0), hlens, ylens, blank=self.blank, zero_infinity=True)
        sos = torch.full((1,), self.sos, dtype=torch.long)
        ys_in = nn.utils.rnn.pad_sequence([torch.cat([sos, y]) for y in ys], batch_first=True,
                                          padding_value=self.eos).to(dev)
        ys_out = nn.utils.rnn.pad_sequence([torch.cat([y, sos]) for y in ys], batch_first=True,
                                           padding_value=-1).to(dev)
        logits = self.decode(ys_in, mem, mask)
        l_att = F.cross_entropy(logits.view(-1, self.odim), ys_out.view(-1), ignore_index=-1, label_smoothing=0.1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att, l_ctc, l_att

    @torch.no_grad()
    def beam_search(self, x, lens, beam=10, penalty=0.0):
        mem, hlens, mask = self.encode(x, lens)
        maxlen = max(1, int(hlens[0]))
        hyps = [([self.sos], 0.0)]
        ended = []
        for i in range(maxlen):
            ys = torch.tensor([h for h, _ in hyps], device=x.device)
            lp = self.decode(ys, mem.expand(len(hyps), -1, -1), mask.expand(len(hyps), -1))[:, -1].log_softmax(-1)
            cand = []
            for j, (h, s) in enumerate(hyps):
                top, idx = lp[j].topk(beam)
                for v, k in zip(top.tolist(), idx.tolist()):
                    cand.append((h + [k], s + v + penalty))
            cand.sort(key=lambda c: -c[1])
            hyps = []
            for h, s in cand[:beam]:
                (ended if h[-1] == self.eos else hyps).append((h, s))
            if not hyps or len(ended) >= beam:
                break
        best = max(ended + hyps, key=lambda c: c[1] / len(c[0]))[0]
        return [t for t in best[1:] if t != self.eos]


def dev_wer(model, dataset, sp, device, beam):
    model.eval()
    err = words = 0
    for i in range(len(dataset)):
        x, _, ref = dataset[i]
        hyp = sp.decode(model.beam_search(x[None].to(device), torch.tensor([x.size(0)], device=device), beam))
        err += editdistance.eval(ref.split(), hyp.split())
        words += len(ref.split())
    model.train()
    return 100.0 * err / max(1, words)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    sp = spm.SentencePieceProcessor(model_file=args.bpe)
    train_set = UttDataset([args.train], sp, args.max_frames)
    dev_set = UttDataset(args.dev, sp)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True)

    model = JointCTCAttention(sp.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))

    writer = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.exp, "tb"))
    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, xl, ys, _ in loader:
            loss, l_ctc, l_att = model(x.to(device, non_blocking=True), xl.to(device), ys, args.ctc_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/ctc", l_ctc.item(), step)
                writer.add_scalar("train/att", l_att.item(), step)
                writer.add_scalar("train/grad_norm", gn.item(), step)

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.exp, f"epoch{epoch}.pth"))
            wer = dev_wer(model.module, dev_set, sp, device, args.beam)
            writer.add_scalar("dev/wer", wer, epoch)
            print(f"epoch {epoch} | step {step} | dev WER {wer:.2f} | {time.time() - t0:.0f}s", flush=True)
            if wer < best:
                best = wer
                torch.save(model.module.state_dict(), os.path.join(args.exp, "valid.wer.best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
