"""LRS2 audio-visual speech recognition, single-node multi-GPU via torch.multiprocessing.

Run on one machine (uses every visible GPU):
    python 12_lrs2_avsr_spawn.py --data-root /data/LRS2 --save-dir runs/lrs2_av
"""
import argparse
import os
import random
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--spm-model", default="assets/lrs2_unigram500.model")
    parser.add_argument("--save-dir", default="runs/lrs2_av")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--ctc-weight", type=float, default=0.2)
    parser.add_argument("--port", type=str, default="29531")
    parser.add_argument("--seed", type=int, default=11)
    return parser


class LRS2AV(Dataset):
    def __init__(self, root, split, sp, augment):
        self.root, self.sp, self.augment = root, sp, augment
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [x.split()[0] for x in f if x.strip()]
        with open(os.path.join(root, "transcripts.tsv")) as f:
            self.text = dict(line.rstrip("\n").split("\t", 1) for line in f)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        uid = self.ids[i]
        video = np.load(os.path.join(self.root, "roi_96", uid + ".npy"))
        fbank = np.load(os.path.join(self.root, "fbank80", uid + ".npy"))
        if self.augment:
            oy, ox = random.randint(0, 8), random.randint(0, 8)
        else:
            oy = ox = 4
        video = video[:, oy:oy + 88, ox:ox + 88].astype(np.float32) / 255.0
        if self.augment and random.random() < 0.5:
            video = video[:, :, ::-1].copy()
        video = (video - 0.421) / 0.165
        need = video.shape[0] * 4
        if len(fbank) < need:
            fbank = np.pad(fbank, ((0, need - len(fbank)), (0, 0)), mode="edge")
        fbank = fbank[:need]
        if self.augment:
            # SpecAugment-style frequency masks
            for _ in range(2):
                f = random.randint(0, 27)
                f0 = random.randint(0, 80 - f)
                fbank[:, f0:f0 + f] = 0.0
        text = self.text[uid]
        return torch.from_numpy(video), torch.from_numpy(fbank.astype(np.float32)), \
            torch.tensor(self.sp.encode(text.lower())) + 1, text


def pad_collate(batch):
    v, a, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(v, batch_first=True), nn.utils.rnn.pad_sequence(a, batch_first=True),
            torch.tensor([len(x) for x in v]), nn.utils.rnn.pad_sequence(y, batch_first=True),
            torch.tensor([len(x) for x in y]), list(t))


class AVNet(nn.Module):
    def __init__(self, vocab, d=512):
        super().__init__()
        self.vid = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(128), nn.ReLU(True),
            nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(256), nn.ReLU(True),
            nn.AdaptiveAvgPool3d((None, 1, 1)))
        self.aud = nn.Sequential(nn.Conv1d(80, 256, 5, 2, 2), nn.BatchNorm1d(256), nn.ReLU(True),
                                 nn.Conv1d(256, 256, 5, 2, 2), nn.BatchNorm1d(256), nn.ReLU(True))
        self.inp = nn.Linear(512, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), 12)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), 6)
        self.emb = nn.Embedding(vocab, d)
        self.pe = nn.Parameter(torch.randn(1, 1600, d) * 0.02)
        self.ctc_fc = nn.Linear(d, vocab)
        self.att_fc = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        hv = self.vid(v.unsqueeze(1)).flatten(2).transpose(1, 2)
        ha = self.aud(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        x = self.inp(torch.cat([hv, ha], -1)) + self.pe[:, :t]
        mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        return self.enc(x, src_key_padding_mask=mask), mask

    def forward(self, v, a, lens, y, ylens):
        mem, mask = self.encode(v, a, lens)
        ctc_lp = self.ctc_fc(mem).float().log_softmax(-1)
        y_in = F.pad(y, (1, 0), value=self.eos)
        y_out = F.pad(y, (0, 1), value=0)
        y_out[torch.arange(y.size(0)), ylens] = self.eos
        y_out[torch.arange(y_out.size(1), device=y.device)[None] > ylens[:, None]] = -100
        L = y_in.size(1)
        h = self.dec(self.emb(y_in) + self.pe[:, :L], mem, memory_key_padding_mask=mask,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        return ctc_lp, self.att_fc(h).float(), y_out


def main_worker(gpu, args):
    ngpus = torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", world_size=ngpus, rank=gpu)
    random.seed(args.seed + gpu)
    torch.manual_seed(args.seed)
    device = torch.device("cuda", gpu)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    vocab = sp.get_piece_size() + 2
    train_set = LRS2AV(args.data_root, "train", sp, augment=True)
    val_set = LRS2AV(args.data_root, "val", sp, augment=False)
    train_sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers, collate_fn=pad_collate, pin_memory=True)
    val_loader = DataLoader(Subset(val_set, range(gpu, len(val_set), ngpus)), batch_size=args.batch_size,
                            num_workers=args.workers, collate_fn=pad_collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AVNet(vocab)).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    writer = SummaryWriter(args.save_dir) if gpu == 0 else None

    best_wer = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (v, a, lens, y, ylens, _) in enumerate(train_loader):
            v, a, lens, y, ylens = (x.cuda(gpu, non_blocking=True) for x in (v, a, lens, y, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctc_lp, att_logits, y_out = model(v, a, lens, y, ylens)
            l_ctc = F.ctc_loss(ctc_lp.transpose(0, 1), y, lens, ylens, zero_infinity=True)
            l_att = F.cross_entropy(att_logits.flatten(0, 1), y_out.flatten(), ignore_index=-100, label_smoothing=0.1)
            loss = args.ctc_weight * l_ctc + (1 - args.ctc_weight) * l_att
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if writer is not None and it % 100 == 0:
                gstep = epoch * len(train_loader) + it
                writer.add_scalar("loss/ctc", l_ctc.item(), gstep)
                writer.add_scalar("loss/att", l_att.item(), gstep)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], gstep)

        model.eval()
        err = torch.zeros(2, device=device)
        with torch.no_grad():
            for v, a, lens, _, _, texts in val_loader:
                v, a, lens = v.to(device), a.to(device), lens.to(device)
                mem, _ = model.module.encode(v, a, lens)
                best = model.module.ctc_fc(mem).argmax(-1)
                for b, n, ref in zip(best, lens.tolist(), texts):
                    ids = [t - 1 for t in torch.unique_consecutive(b[:n]).tolist() if 0 < t < vocab - 1]
                    err[0] += editdistance.eval(sp.decode(ids).split(), ref.lower().split())
                    err[1] += len(ref.split())
        dist.all_reduce(err)
        wer = (err[0] / err[1]).item()
        if gpu == 0:
            writer.add_scalar("val/wer", wer, epoch)
            print(f"epoch {epoch}  val WER {wer * 100:.2f}%  ({time.time() - tic:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    args = get_parser().parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    ngpus = torch.cuda.device_count()
    print(f"spawning {ngpus} workers")
    mp.spawn(main_worker, nprocs=ngpus, args=(args))


if __name__ == "__main__":
    main()
