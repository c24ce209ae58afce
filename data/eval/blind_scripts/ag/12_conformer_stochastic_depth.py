"""Conformer-CTC (large) with stochastic depth, SpecAugment and gradient accumulation.

torchrun --nnodes=1 --nproc_per_node=8 12_conformer_stochastic_depth.py --config conf/conformer_ctc_large.yaml
"""
import argparse
import contextlib
import json
import logging
import math
import os

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("train")


class ManifestDataset(Dataset):
    def __init__(self, manifest, tokenizer, max_duration=20.0):
        self.items = []
        with open(manifest) as f:
            for line in f:
                d = json.loads(line)
                if d["duration"] <= max_duration:
                    self.items.append(d)
        self.tok = tokenizer
        self.featurizer = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                               n_mels=80)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = self.items[i]
        wav, sr = torchaudio.load(d["audio_filepath"])
        feats = torch.log(self.featurizer(wav[0]) + 2 ** -24).T
        feats = (feats - feats.mean(0, keepdim=True)) / (feats.std(0, keepdim=True) + 1e-5)
        return feats, torch.tensor(self.tok.encode(d["text"]), dtype=torch.long)


def collate(batch):
    x, y = zip(*batch)
    return (nn.utils.rnn.pad_sequence(x, batch_first=True), torch.tensor([t.size(0) for t in x]),
            nn.utils.rnn.pad_sequence(y, batch_first=True), torch.tensor([t.size(0) for t in y]))


class FeedForward(nn.Module):
    def __init__(self, d, mult=4, p=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * mult), nn.SiLU(), nn.Dropout(p),
                                 nn.Linear(d * mult, d), nn.Dropout(p))

    def forward(self, x):
        return self.net(x)


class ConvModule(nn.Module):
    def __init__(self, d, kernel=31, p=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x, pad_mask):
        x = self.norm(x).masked_fill(pad_mask.unsqueeze(-1), 0.0).transpose(1, 2)
        x = F.glu(self.pw1(x), dim=1)
        x = F.silu(self.bn(self.dw(x)))
        return self.drop(self.pw2(x).transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, p=0.1):
        super().__init__()
        self.ff1 = FeedForward(d, p=p)
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.conv = ConvModule(d, p=p)
        self.ff2 = FeedForward(d, p=p)
        self.out_norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        a = self.attn_norm(x)
        x = x + self.drop(self.attn(a, a, a, key_padding_mask=pad_mask, need_weights=False)[0])
        x = x + self.conv(x, pad_mask)
        x = x + 0.5 * self.ff2(x)
        return self.out_norm(x)


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d_model=512, n_layers=18, heads=8, stochastic_depth=0.1):
        super().__init__()
        self.pre = nn.Sequential(nn.Conv2d(1, d_model, 3, 2, 1), nn.SiLU(), nn.Conv2d(d_model, d_model, 3, 2, 1),
                                 nn.SiLU())
        self.pre_out = nn.Linear(d_model * 20, d_model)
        self.layers = nn.ModuleList([ConformerBlock(d_model, heads) for _ in range(n_layers)])
        # linearly increasing drop probability, as in the stochastic depth paper
        self.drop_probs = [stochastic_depth * (i + 1) / n_layers for i in range(n_layers)]
        self.ctc_head = nn.Linear(d_model, vocab + 1)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(27)
        self.time_mask = torchaudio.transforms.TimeMasking(100, iid_masks=True, p=0.05)

    def forward(self, x, lens):
        if self.training:
            x = x.transpose(1, 2)
            for _ in range(2):
                x = self.freq_mask(x)
            for _ in range(5):
                x = self.time_mask(x)
            x = x.transpose(1, 2)
        x = self.pre(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.pre_out(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = (lens + 1) // 2
        lens = (lens + 1) // 2
        pad_mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        for layer, p in zip(self.layers, self.drop_probs):
            if self.training and torch.rand(()) < p:
                continue
            x = layer(x, pad_mask)
        return self.ctc_head(x).log_softmax(-1), lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = OmegaConf.load(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    tok = spm.SentencePieceProcessor(model_file=cfg.tokenizer)
    vocab = tok.get_piece_size()
    blank = vocab
    train_ds = ManifestDataset(cfg.train_manifest, tok, cfg.max_duration)
    dev_ds = ManifestDataset(cfg.dev_manifest, tok, 1e9)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=cfg.batch_size,
                        collate_fn=collate, num_workers=2)

    torch.manual_seed(cfg.seed)
    model = ConformerCTC(vocab, cfg.d_model, cfg.n_layers, cfg.heads, cfg.stochastic_depth).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    total = cfg.epochs * len(train_dl) // cfg.accum_grad
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / cfg.warmup, 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0)))))
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(os.path.join(cfg.exp_dir, "tb")) if rank == 0 else None

    update = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, xl, y, yl) in enumerate(train_dl):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            last_micro = (i + 1) % cfg.accum_grad == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    lp, ol = model(x, xl)
                loss = F.ctc_loss(lp.float().transpose(0, 1), y, ol, yl, blank=blank, zero_infinity=True)
                scaler.scale(loss / cfg.accum_grad).backward()
            if not last_micro:
                continue
            scaler.unscale_(opt)
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            update += 1
            if writer is not None and update % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), update)
                writer.add_scalar("train/grad_norm", gn.item(), update)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], update)

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, xl, y, yl in dev_dl:
                x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
                lp, ol = model.module(x, xl)
                stats[0] += F.ctc_loss(lp.transpose(0, 1), y, ol, yl, blank=blank, reduction="sum",
                                       zero_infinity=True)
                stats[1] += yl.sum()
        dist.all_reduce(stats)
        dev_loss = (stats[0] / stats[1]).item()
        log.info("epoch %d update %d dev ctc/token %.4f", epoch, update, dev_loss)
        if rank == 0:
            writer.add_scalar("dev/ctc_per_token", dev_loss, update)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "update": update}, os.path.join(cfg.exp_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
