"""Hybrid CTC/attention AVSR: video ResNet frontend + fbank audio, fused and
encoded with torchaudio's Conformer; transformer decoder over BPE units.

Usage:
    torchrun --nproc_per_node=8 05_avsr_conformer_hybrid.py --manifest-dir data/lrs3 \
        --bpe data/lrs3/bpe500.model --exp exp/avsr_hybrid
"""
import argparse
import logging
import math
import os
from pathlib import Path

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", type=Path, required=True)
    ap.add_argument("--bpe", required=True)
    ap.add_argument("--exp", type=Path, default=Path("exp/avsr_hybrid"))
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    ap.add_argument("--mtl-alpha", type=float, default=0.3, help="CTC weight")
    ap.add_argument("--num-workers", type=int, default=6)
    ap.add_argument("--log-interval", type=int, default=50)
    return ap.parse_args()


class AVDataset(Dataset):
    def __init__(self, manifest, bpe):
        self.rows = [l.rstrip("\n").split("\t") for l in open(manifest)]
        self.bpe = bpe
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        vid_path, wav_path, text = self.rows[i]
        video = torch.from_numpy(np.load(vid_path)).float().div_(255.0).sub_(0.421).div_(0.165)
        wav, sr = torchaudio.load(wav_path)
        feats = (self.fbank(wav[0]) + 1e-6).log().t()  # 100 fps
        t = video.size(0)
        feats = feats[: 4 * t]
        if feats.size(0) < 4 * t:
            feats = F.pad(feats, (0, 0, 0, 4 * t - feats.size(0)))
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        ys = torch.tensor(self.bpe.encode(text), dtype=torch.long) + 1
        return video, feats, ys


def collate_fn(batch):
    batch = sorted(batch, key=lambda b: -b[0].size(0))
    v, a, y = zip(*batch)
    return dict(video=pad_sequence(v, batch_first=True), audio=pad_sequence(a, batch_first=True),
                lengths=torch.tensor([x.size(0) for x in v]),
                ys=pad_sequence(y, batch_first=True, padding_value=-1),
                ylens=torch.tensor([x.size(0) for x in y]))


class VideoFrontend(nn.Module):
    def __init__(self, odim):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                  nn.BatchNorm3d(64), nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r18 = torchvision.models.resnet18()
        self.resnet = nn.Sequential(r18.layer1, r18.layer2, r18.layer3, r18.layer4, nn.AdaptiveAvgPool2d(1))
        self.out = nn.Linear(512, odim)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.stem(x.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return self.out(self.resnet(x).flatten(1)).view(b, t, -1)


class AVHybrid(nn.Module):
    def __init__(self, odim, adim=256):
        super().__init__()
        self.vfront = VideoFrontend(adim)
        self.afront = nn.Sequential(nn.Conv1d(80, adim, 5, stride=2, padding=2), nn.GELU(),
                                    nn.Conv1d(adim, adim, 5, stride=2, padding=2), nn.GELU())
        self.fusion = nn.Sequential(nn.Linear(2 * adim, 4 * adim), nn.GELU(), nn.Linear(4 * adim, adim))
        self.encoder = Conformer(input_dim=adim, num_heads=4, ffn_dim=2048, num_layers=12,
                                 depthwise_conv_kernel_size=31, dropout=0.1)
        layer = nn.TransformerDecoderLayer(adim, 4, 2048, 0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 6)
        self.embed = nn.Embedding(odim, adim)
        self.ctc_lo = nn.Linear(adim, odim)
        self.dec_lo = nn.Linear(adim, odim)
        self.odim = odim

    def encode(self, video, audio, lengths):
        v = self.vfront(video)
        a = self.afront(audio.transpose(1, 2)).transpose(1, 2)[:, : v.size(1)]
        x = self.fusion(torch.cat([v, a], -1))
        x, lengths = self.encoder(x, lengths)
        return x, lengths

    def forward(self, video, audio, lengths, ys_in):
        enc, lengths = self.encode(video, audio, lengths)
        mask = torch.arange(enc.size(1), device=enc.device)[None] >= lengths[:, None]
        causal = torch.triu(torch.ones(ys_in.size(1), ys_in.size(1), dtype=torch.bool, device=enc.device), 1)
        dec = self.decoder(self.embed(ys_in), enc, tgt_mask=causal, memory_key_padding_mask=mask)
        return self.ctc_lo(enc), self.dec_lo(dec), lengths


def add_sos_eos(ys, ylens, sos):
    ys_in = [torch.cat([ys.new_tensor([sos]), y[:n]]) for y, n in zip(ys, ylens)]
    ys_out = [torch.cat([y[:n], ys.new_tensor([sos])]) for y, n in zip(ys, ylens)]
    return pad_sequence(ys_in, batch_first=True, padding_value=sos), pad_sequence(ys_out, batch_first=True, padding_value=-1)


def hybrid_loss(ctc_logits, dec_logits, lengths, ys, ylens, ys_out, alpha):
    targets = torch.cat([y[:n] for y, n in zip(ys, ylens)])
    l_ctc = F.ctc_loss(ctc_logits.float().log_softmax(-1).transpose(0, 1), targets, lengths, ylens, blank=0)
    l_att = F.cross_entropy(dec_logits.float().transpose(1, 2), ys_out, ignore_index=-1, label_smoothing=0.1)
    return alpha * l_ctc + (1 - alpha) * l_att, l_ctc.detach(), l_att.detach()


@torch.no_grad()
def ctc_wer(model, loader, bpe, device):
    model.eval()
    e = n = 0
    for b in loader:
        enc, lens = model.encode(b["video"].to(device), b["audio"].to(device), b["lengths"].to(device))
        best = model.ctc_lo(enc).argmax(-1).cpu()
        for i in range(best.size(0)):
            ids = [t - 1 for t in torch.unique_consecutive(best[i, : lens[i]]).tolist() if 0 < t < model.odim - 1]
            hyp = bpe.decode(ids).split()
            ref = bpe.decode((b["ys"][i, : b["ylens"][i]] - 1).tolist()).split()
            e += editdistance.eval(hyp, ref)
            n += len(ref)
    model.train()
    return e / max(n, 1)


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"%(asctime)s rank{rank} %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(7)

    bpe = spm.SentencePieceProcessor(model_file=args.bpe)
    odim = bpe.get_piece_size() + 2
    sos = odim - 1
    train_ds = AVDataset(args.manifest_dir / "train.tsv", bpe)
    valid_ds = AVDataset(args.manifest_dir / "valid.tsv", bpe)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate_fn,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, 16, shuffle=False, collate_fn=collate_fn, num_workers=args.num_workers)

    model = AVHybrid(odim).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        args.exp.mkdir(parents=True, exist_ok=True)
    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for b in train_dl:
            video, audio = b["video"].to(device, non_blocking=True), b["audio"].to(device, non_blocking=True)
            lengths, ys, ylens = b["lengths"].to(device), b["ys"].to(device), b["ylens"].to(device)
            ys_in, ys_out = add_sos_eos(ys, ylens, sos)
            with torch.autocast("cuda", dtype=torch.float16):
                ctc_logits, dec_logits, enc_lens = model(video, audio, lengths, ys_in)
            loss, l_ctc, l_att = hybrid_loss(ctc_logits, dec_logits, enc_lens, ys, ylens, ys_out, args.mtl_alpha)

            if not torch.isfinite(loss):
                logging.warning("non-finite loss at step %d (ctc=%.3f att=%.3f), skipping batch",
                                step, l_ctc.item(), l_att.item())
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_interval == 0:
                logging.info("ep %d step %d loss %.3f ctc %.3f att %.3f gnorm %.2f lr %.2e", epoch, step,
                             loss.item(), l_ctc.item(), l_att.item(), grad_norm.item(), scheduler.get_last_lr()[0])

        if rank == 0:
            wer = ctc_wer(model.module, valid_dl, bpe, device)
            logging.info("epoch %d valid CTC WER %.2f", epoch, 100 * wer)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       args.exp / f"epoch{epoch}.pt")
            if wer < best:
                best = wer
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.exp / "model.best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
