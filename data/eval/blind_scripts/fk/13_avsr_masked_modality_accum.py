"""AVSR (LRS3) with utterance-level modality masking, SyncBN frontends and
gradient accumulation. CTC + attention joint training, BPE-1000 units.

    torchrun --nproc_per_node=8 13_avsr_masked_modality_accum.py --cfg conf/avsr_base.yaml

conf/avsr_base.yaml overrides any key of DEFAULTS below.
"""
import argparse
import contextlib
import math
import os
import random
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchvision
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = OmegaConf.create(dict(
    data=dict(root="/data/lrs3", train="train.tsv", valid="valid.tsv", bpe="bpe/unigram1000.model", max_len=600),
    model=dict(d=512, enc_layers=12, dec_layers=6, heads=8),
    optim=dict(lr_per_256=1e-3, warmup=10000, wd=0.03, clip=5.0),
    train=dict(batch_per_gpu=8, accum=4, max_epochs=75, ctc_weight=0.1, p_mask_video=0.2, p_mask_audio=0.2),
    out="exp/avsr_masked",
    resume=True,
))


class AVData(Dataset):
    def __init__(self, root, tsv, bpe, max_len):
        self.root, self.bpe = root, bpe
        self.rows = []
        for line in open(os.path.join(root, tsv)):
            vid, wav, n, text = line.rstrip("\n").split("\t")
            if int(n) <= max_len:
                self.rows.append((vid, wav, text))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        vid, wav, text = self.rows[i]
        v = torch.from_numpy(np.load(os.path.join(self.root, vid))).float().div_(255.0).sub_(0.421).div_(0.165)
        a, _ = torchaudio.load(os.path.join(self.root, wav))
        a = a[0, : 640 * v.size(0)]
        a = F.pad(a, (0, 640 * v.size(0) - a.numel()))
        a = (a - a.mean()) / (a.std() + 1e-5)
        return v, a, torch.tensor(self.bpe.encode(text), dtype=torch.long) + 1


def collate(b):
    v, a, y = zip(*b)
    return (pad_sequence(v, True), pad_sequence(a, True), torch.tensor([x.size(0) for x in v]),
            pad_sequence(y, True, padding_value=-1), torch.tensor([x.numel() for x in y]))


class VideoResNet(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64),
                                  nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r = torchvision.models.resnet18()
        self.body = nn.Sequential(r.layer1, r.layer2, r.layer3, r.layer4, nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(512, d)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.stem(x.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return self.fc(self.body(x).flatten(1)).view(b, t, -1)


class AudioResNet1D(nn.Module):
    def __init__(self, d):
        super().__init__()
        layers, c = [], 1
        for co, k, s in [(64, 80, 4), (64, 3, 2), (128, 3, 2), (256, 3, 2), (512, 3, 2), (512, 5, 5)]:
            layers += [nn.Conv1d(c, co, k, s, padding=k // 2, bias=False), nn.BatchNorm1d(co), nn.ReLU(True)]
            c = co
        self.net = nn.Sequential(*layers)  # total stride 4*2*2*2*2*5 = 640
        self.fc = nn.Linear(512, d)

    def forward(self, a, t):
        x = self.net(a.unsqueeze(1)).transpose(1, 2)[:, :t]
        return self.fc(F.pad(x, (0, 0, 0, t - x.size(1))))


class AVSRModel(nn.Module):
    def __init__(self, vocab, d, enc_layers, dec_layers, heads):
        super().__init__()
        self.vocab = vocab
        self.vfe, self.afe = VideoResNet(d), AudioResNet1D(d)
        self.fuse = nn.Linear(2 * d, d)
        self.pos = nn.Embedding(2048, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True), enc_layers)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True), dec_layers)
        self.emb = nn.Embedding(vocab, d)
        self.ctc_out = nn.Linear(d, vocab)
        self.att_out = nn.Linear(d, vocab)

    def encode(self, v, a, lens, keep_v=None, keep_a=None):
        hv, ha = self.vfe(v), self.afe(a, v.size(1))
        if keep_v is not None:
            # masking after the frontends: every parameter still takes part in the graph
            hv, ha = hv * keep_v[:, None, None], ha * keep_a[:, None, None]
        pad = torch.arange(v.size(1), device=v.device)[None] >= lens[:, None]
        x = self.fuse(torch.cat([hv, ha], -1)) + self.pos.weight[: v.size(1)]
        return self.enc(x, src_key_padding_mask=pad), pad

    def forward(self, v, a, lens, ys_in, keep_v, keep_a):
        mem, pad = self.encode(v, a, lens, keep_v, keep_a)
        L = ys_in.size(1)
        causal = torch.triu(torch.full((L, L), float("-inf"), device=v.device), 1)
        h = self.dec(self.emb(ys_in) + self.pos.weight[:L], mem, tgt_mask=causal, memory_key_padding_mask=pad)
        return self.ctc_out(mem).float().log_softmax(-1), self.att_out(h).float()


def joint_loss(ctc_lp, att_logits, lens, ys, ylens, sos, w):
    tgt = torch.cat([y[:n] for y, n in zip(ys, ylens)])
    ctc = F.ctc_loss(ctc_lp.transpose(0, 1), tgt, lens, ylens, zero_infinity=True)
    ys_out = torch.full((ys.size(0), ys.size(1) + 1), -1, dtype=torch.long, device=ys.device)
    for i, n in enumerate(ylens.tolist()):
        ys_out[i, :n], ys_out[i, n] = ys[i, :n], sos
    att = F.cross_entropy(att_logits.transpose(1, 2), ys_out, ignore_index=-1, label_smoothing=0.1)
    return w * ctc + (1 - w) * att


@torch.no_grad()
def evaluate(net, loader, bpe, device):
    net.eval()
    counts = torch.zeros(2, device=device)
    for v, a, lens, ys, ylens in loader:
        mem, _ = net.encode(v.to(device), a.to(device), lens.to(device))
        best = net.ctc_out(mem).argmax(-1).cpu()
        for i in range(best.size(0)):
            hyp = [t - 1 for t in torch.unique_consecutive(best[i, : lens[i]]).tolist() if 0 < t < net.vocab - 1]
            ref = bpe.decode((ys[i, : ylens[i]] - 1).tolist()).split()
            counts[0] += editdistance.eval(bpe.decode(hyp).split(), ref)
            counts[1] += len(ref)
    dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.load(a.cfg) if a.cfg else {}, OmegaConf.from_dotlist(a.overrides))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(1)

    bpe = spm.SentencePieceProcessor(model_file=os.path.join(cfg.data.root, cfg.data.bpe))
    vocab = bpe.get_piece_size() + 2
    sos = vocab - 1
    train_set = AVData(cfg.data.root, cfg.data.train, bpe, cfg.data.max_len)
    valid_set = AVData(cfg.data.root, cfg.data.valid, bpe, 10 ** 6)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    tl = DataLoader(train_set, cfg.train.batch_per_gpu, sampler=sampler, collate_fn=collate, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    vl = DataLoader(Subset(valid_set, range(rank, len(valid_set), world)), 8, collate_fn=collate, num_workers=4)

    net = AVSRModel(vocab, **cfg.model)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    accum = cfg.train.accum
    global_batch = cfg.train.batch_per_gpu * accum * world
    peak_lr = cfg.optim.lr_per_256 * global_batch / 256
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.98), weight_decay=cfg.optim.wd)
    updates_per_epoch = len(tl) // accum
    total = cfg.train.max_epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / cfg.optim.warmup) *
                                              0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt_path = os.path.join(cfg.out, "last.pt")
    start_epoch, best = 0, float("inf")
    if cfg.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    writer = None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out, "tb"))
        print(f"global batch {global_batch} -> peak lr {peak_lr:.2e}", flush=True)

    for epoch in range(start_epoch, cfg.train.max_epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (v, a, lens, ys, ylens) in enumerate(tl):
            if i >= updates_per_epoch * accum:
                break
            v, a, lens = v.to(dev, non_blocking=True), a.to(dev, non_blocking=True), lens.to(dev)
            ys, ylens = ys.to(dev), ylens.to(dev)
            ys_in = torch.cat([torch.full_like(ys[:, :1], sos), ys.clamp(min=0)], 1)
            r = torch.rand(v.size(0), device=dev)
            keep_v = (r >= cfg.train.p_mask_video).float()
            keep_a = ((r < cfg.train.p_mask_video) | (r >= cfg.train.p_mask_video + cfg.train.p_mask_audio)).float()
            boundary = (i + 1) % accum == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ctc_lp, att_logits = model(v, a, lens, ys_in, keep_v, keep_a)
                loss = joint_loss(ctc_lp, att_logits, lens, ys, ylens, sos, cfg.train.ctc_weight)
                (loss / accum).backward()
            if boundary:
                gn = nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0 and sched.last_epoch % 100 == 0:
                    writer.add_scalar("train/loss", loss.item(), sched.last_epoch)
                    writer.add_scalar("train/grad_norm", gn.item(), sched.last_epoch)

        wer = evaluate(net, vl, bpe, dev)
        best = min(best, wer)
        if rank == 0:
            print(f"epoch {epoch} valid WER {100 * wer:.2f} (best {100 * best:.2f}) {time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("valid/wer", wer, epoch)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "best": best}
            torch.save(ck, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if wer == best:
                torch.save(net.state_dict(), os.path.join(cfg.out, "best_model.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
