# -*- coding: utf-8 -*-
"""
Transformer AVSR baseline (TM-CTC + TM-seq2seq style) on LRS3.

Launch on one 8-GPU node:
    torchrun --nproc_per_node=8 16_avsr_transformer_lrs3.py --data_dir /data/lrs3 --exp_dir exp/tm_av
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser("TM AVSR")
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--exp_dir", type=str, default="exp/tm_av")
    parser.add_argument("--spm_model", type=str, default="data/spm/lrs3_unigram1000.model")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=25000)
    parser.add_argument("--ctc_weight", type=float, default=0.2)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--log_interval", type=int, default=100)
    return parser.parse_args()


def setup_logger(exp_dir, rank):
    logger = logging.getLogger("tm_av")
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    fmt = logging.Formatter("%(asctime)s | %(message)s")
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(exp_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


class LRS3AV(Dataset):
    def __init__(self, data_dir, subset, sp, train):
        self.data_dir, self.sp, self.train = data_dir, sp, train
        with open(os.path.join(data_dir, f"{subset}.json")) as f:
            self.items = json.load(f)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        it = self.items[idx]
        v = np.load(os.path.join(self.data_dir, it["video"]))
        a = np.load(os.path.join(self.data_dir, it["audio"]))
        if self.train:
            oy, ox = np.random.randint(0, 9, size=2)
        else:
            oy, ox = 4, 4
        v = v[:, oy:oy + 88, ox:ox + 88].astype(np.float32) / 255.0
        v = (v - 0.421) / 0.165
        n = 4 * v.shape[0]
        a = np.pad(a, ((0, max(0, n - a.shape[0])), (0, 0)))[:n].astype(np.float32)
        y = torch.LongTensor(self.sp.encode(it["text"].lower())) + 1
        return torch.from_numpy(v), torch.from_numpy(a), y, it["text"].lower()


def collate_fn(batch):
    v, a, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(v, batch_first=True), nn.utils.rnn.pad_sequence(a, batch_first=True),
            torch.LongTensor([x.shape[0] for x in v]), nn.utils.rnn.pad_sequence(y, batch_first=True),
            torch.LongTensor([x.shape[0] for x in y]), list(t))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=2000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class TMAV(nn.Module):
    def __init__(self, vocab, d=512):
        super().__init__()
        self.visual = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            nn.Conv3d(64, 128, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(128), nn.ReLU(True),
            nn.Conv3d(128, 256, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(256), nn.ReLU(True),
            nn.Conv3d(256, 512, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(512), nn.ReLU(True))
        self.v_proj = nn.Linear(512, d)
        self.a_proj = nn.Sequential(nn.Conv1d(80, d, 4, 4), nn.ReLU(True))
        self.pe = PositionalEncoding(d)
        self.v_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.a_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.joint = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(True), nn.LayerNorm(d))
        self.ctc_fc = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.fc = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        m = torch.arange(t, device=v.device)[None] >= lens[:, None]
        hv = self.v_proj(self.visual(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2))
        ha = self.a_proj(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        hv = self.v_enc(self.pe(hv), src_key_padding_mask=m)
        ha = self.a_enc(self.pe(ha), src_key_padding_mask=m)
        return self.joint(torch.cat([hv, ha], -1)), m

    def forward(self, v, a, lens, y, ylens):
        mem, m = self.encode(v, a, lens)
        ctc_lp = self.ctc_fc(mem).float().log_softmax(-1)
        yi = F.pad(y, (1, 0), value=self.eos)
        L = yi.size(1)
        h = self.dec(self.pe(self.emb(yi)), mem, memory_key_padding_mask=m,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        return ctc_lp, self.fc(h).float()


def targets_with_eos(y, ylens, eos):
    yo = F.pad(y, (0, 1))
    yo[torch.arange(y.size(0)), ylens] = eos
    return yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logger = setup_logger(args.exp_dir, rank)
    logger.info("world size %d, args %s", world_size, vars(args))
    torch.manual_seed(1)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    vocab = sp.get_piece_size() + 2
    train_set = LRS3AV(args.data_dir, "trainval", sp, train=True)
    test_set = LRS3AV(args.data_dir, "test", sp, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate_fn, pin_memory=True, drop_last=True)
    test_idx = list(range(rank, len(test_set), world_size))
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_idx), batch_size=args.batch_size,
                             num_workers=4, collate_fn=collate_fn)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(TMAV(vocab)).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup_steps, (args.warmup_steps / (s + 1)) ** 0.5))

    best_wer, global_step = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for v, a, lens, y, ylens, _ in train_loader:
            v, a, lens = v.to(device, non_blocking=True), a.to(device, non_blocking=True), lens.to(device)
            y, ylens = y.to(device), ylens.to(device)
            ctc_lp, logits = model(v, a, lens, y, ylens)
            l_ctc = F.ctc_loss(ctc_lp.transpose(0, 1), y, lens, ylens, zero_infinity=True)
            l_att = F.cross_entropy(logits.transpose(1, 2), targets_with_eos(y, ylens, vocab - 1), ignore_index=-100,
                                    label_smoothing=0.1)
            loss = args.ctc_weight * l_ctc + (1 - args.ctc_weight) * l_att
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if global_step % args.log_interval == 0:
                logger.info("ep %d step %d loss %.3f (ctc %.3f att %.3f) lr %.2e %.1f s", epoch, global_step,
                            loss.item(), l_ctc.item(), l_att.item(), scheduler.get_last_lr()[0], time.time() - t0)

        # test-set WER with greedy CTC
        model.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for v, a, lens, _, _, refs in test_loader:
                mem, _ = model.module.encode(v.to(device), a.to(device), lens.to(device))
                for row, n, ref in zip(model.module.ctc_fc(mem).argmax(-1), lens.tolist(), refs):
                    hyp = sp.decode([t - 1 for t in torch.unique_consecutive(row[:n]).tolist() if 0 < t < vocab - 1])
                    counts[0] += editdistance.eval(hyp.split(), ref.split())
                    counts[1] += len(ref.split())
        dist.all_reduce(counts)
        wer = (counts[0] / counts[1]).item()
        logger.info("epoch %d: test WER %.2f%%", epoch, 100 * wer)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.exp_dir, f"epoch_{epoch}.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.exp_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
