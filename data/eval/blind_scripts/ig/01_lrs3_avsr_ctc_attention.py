#!/usr/bin/env python3
"""Audio-visual speech recognition on LRS3 with a hybrid CTC/attention objective.

Visual stream: 96x96 grayscale mouth crops at 25 fps (pre-extracted .npy, cropped to 88x88).
Audio stream: 80-dim log-mel filterbanks at 100 fps (pre-extracted .npy).
"""
import argparse
import logging
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("avsr")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--spm-model", required=True)
    p.add_argument("--out-dir", default="exp/lrs3_avsr")
    p.add_argument("--epochs", type=int, default=75)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10000)
    p.add_argument("--weight-decay", type=float, default=0.03)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--enc-layers", type=int, default=12)
    p.add_argument("--dec-layers", type=int, default=6)
    p.add_argument("--ctc-weight", type=float, default=0.1)
    p.add_argument("--modality-dropout", type=float, default=0.25)
    p.add_argument("--max-frames", type=int, default=600)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class AVDataset(Dataset):
    """Manifest: uid \t video.npy \t fbank.npy \t n_frames \t transcript"""

    def __init__(self, manifest, sp, max_frames=None, train=False):
        self.items = []
        with open(manifest) as f:
            for line in f:
                uid, vpath, apath, nframes, text = line.rstrip("\n").split("\t", 4)
                if max_frames and int(nframes) > max_frames:
                    continue
                self.items.append((uid, vpath, apath, text))
        self.sp = sp
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        uid, vpath, apath, text = self.items[idx]
        video = torch.from_numpy(np.load(vpath)).float().div_(255.0)  # T, 96, 96
        if self.train:
            y, x = random.randint(0, 8), random.randint(0, 8)
            video = video[:, y:y + 88, x:x + 88]
            if random.random() < 0.5:
                video = video.flip(-1)
        else:
            video = video[:, 4:92, 4:92]
        video = (video - 0.421) / 0.165
        audio = torch.from_numpy(np.load(apath)).float()  # 4 * T, 80
        n = video.size(0) * 4
        audio = audio[:n] if audio.size(0) >= n else F.pad(audio, (0, 0, 0, n - audio.size(0)))
        tokens = torch.tensor([t + 1 for t in self.sp.encode(text.lower())], dtype=torch.long)
        return uid, video, audio, tokens, text


def collate(batch):
    uids, videos, audios, tokens, texts = zip(*batch)
    v_lens = torch.tensor([v.size(0) for v in videos])
    t_lens = torch.tensor([t.size(0) for t in tokens])
    video = nn.utils.rnn.pad_sequence(videos, batch_first=True)
    audio = nn.utils.rnn.pad_sequence(audios, batch_first=True)
    tgt = nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=-1)
    return uids, video, v_lens, audio, tgt, t_lens, texts


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + idt, inplace=True)


class VisualFrontend(nn.Module):
    """3D conv stem + ResNet-18 trunk applied frame-wise."""

    def __init__(self, d_model):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
            nn.BatchNorm3d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
        )
        self.trunk = nn.Sequential(
            BasicBlock(64, 64), BasicBlock(64, 64),
            BasicBlock(64, 128, 2), BasicBlock(128, 128),
            BasicBlock(128, 256, 2), BasicBlock(256, 256),
            BasicBlock(256, 512, 2), BasicBlock(512, 512),
        )
        self.proj = nn.Linear(512, d_model)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.stem(x.unsqueeze(1))
        x = x.transpose(1, 2).reshape(b * t, 64, x.size(3), x.size(4))
        x = F.adaptive_avg_pool2d(self.trunk(x), 1).flatten(1)
        return self.proj(x.view(b, t, -1))


class AudioFrontend(nn.Module):
    def __init__(self, n_mels, d_model):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(n_mels, d_model, 3, 2, 1), nn.GELU(),
            nn.Conv1d(d_model, d_model, 3, 2, 1), nn.GELU(),
        )

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=3000):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class AVSRModel(nn.Module):
    def __init__(self, vocab_size, d_model, enc_layers, dec_layers, modality_dropout):
        super().__init__()
        self.d_model = d_model
        self.visual = VisualFrontend(d_model)
        self.audio = AudioFrontend(80, d_model)
        self.fusion = nn.Sequential(nn.Linear(2 * d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.pos = PositionalEncoding(d_model)
        enc = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, enc_layers)
        self.ctc_head = nn.Linear(d_model, vocab_size)
        self.embed = nn.Embedding(vocab_size, d_model)
        dec = nn.TransformerDecoderLayer(d_model, 8, 4 * d_model, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec, dec_layers)
        self.out = nn.Linear(d_model, vocab_size)
        self.modality_dropout = modality_dropout
        self.sos = self.eos = vocab_size - 1

    def encode(self, video, audio, v_lens):
        b, t = video.shape[:2]
        use_video, use_audio = True, True
        if self.training and random.random() < self.modality_dropout:
            if random.random() < 0.5:
                use_video = False
            else:
                use_audio = False
        if use_video:
            v = self.visual(video)
        else:
            v = video.new_zeros(b, t, self.d_model)
        if use_audio:
            a = self.audio(audio)[:, :t]
        else:
            a = video.new_zeros(b, t, self.d_model)
        x = self.fusion(torch.cat([v, a], dim=-1))
        pad_mask = torch.arange(t, device=video.device)[None, :] >= v_lens.to(video.device)[:, None]
        return self.encoder(self.pos(x), src_key_padding_mask=pad_mask), pad_mask

    def forward(self, video, v_lens, audio, tgt, t_lens):
        enc, pad_mask = self.encode(video, audio, v_lens)
        log_probs = self.ctc_head(enc).float().log_softmax(-1).transpose(0, 1)
        ctc = F.ctc_loss(log_probs, tgt.clamp(min=0), v_lens, t_lens, blank=0,
                         reduction="sum", zero_infinity=True) / video.size(0)

        b, s = tgt.shape
        ys_in = torch.full((b, s + 1), self.eos, dtype=torch.long, device=tgt.device)
        ys_out = torch.full((b, s + 1), -1, dtype=torch.long, device=tgt.device)
        ys_in[:, 0] = self.sos
        for i, n in enumerate(t_lens.tolist()):
            ys_in[i, 1:n + 1] = tgt[i, :n]
            ys_out[i, :n] = tgt[i, :n]
            ys_out[i, n] = self.eos
        L = s + 1
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=tgt.device), 1)
        in_pad = torch.arange(L, device=tgt.device)[None, :] > t_lens.to(tgt.device)[:, None]
        dec = self.decoder(self.pos(self.embed(ys_in)), enc, tgt_mask=causal,
                           tgt_key_padding_mask=in_pad, memory_key_padding_mask=pad_mask)
        att = F.cross_entropy(self.out(dec).flatten(0, 1).float(), ys_out.flatten(),
                              ignore_index=-1, label_smoothing=0.1)
        return ctc, att

    @torch.no_grad()
    def ctc_greedy(self, video, audio, v_lens):
        enc, _ = self.encode(video, audio, v_lens)
        pred = self.ctc_head(enc).argmax(-1)
        hyps = []
        for p, n in zip(pred, v_lens.tolist()):
            p = torch.unique_consecutive(p[:n])
            hyps.append([int(t) for t in p.tolist() if t != 0 and t != self.eos])
        return hyps


@torch.no_grad()
def evaluate(model, loader, sp, device):
    model.eval()
    errors, words = 0, 0
    for _, video, v_lens, audio, _, _, texts in loader:
        video, audio = video.to(device, non_blocking=True), audio.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hyps = model.module.ctc_greedy(video, audio, v_lens.to(device))
        for h, ref in zip(hyps, texts):
            hyp_words = sp.decode([t - 1 for t in h]).split()
            ref_words = ref.lower().split()
            errors += editdistance.eval(hyp_words, ref_words)
            words += len(ref_words)
    stats = torch.tensor([errors, words], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    vocab_size = sp.get_piece_size() + 2  # + blank, + sos/eos

    train_set = AVDataset(args.train_manifest, sp, args.max_frames, train=True)
    valid_set = AVDataset(args.valid_manifest, sp)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(Subset(valid_set, range(rank, len(valid_set), world_size)),
                              batch_size=args.batch_size, shuffle=False, num_workers=4, collate_fn=collate)

    model = AVSRModel(vocab_size, args.d_model, args.enc_layers, args.dec_layers, args.modality_dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, "last.pt")
    start_epoch, best_wer = 0, float("inf")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_wer = ckpt["epoch"] + 1, ckpt["best_wer"]
        logger.info("resumed from epoch %d", ckpt["epoch"])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (_, video, v_lens, audio, tgt, t_lens, _) in enumerate(train_loader):
            video = video.to(device, non_blocking=True)
            audio = audio.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctc, att = model(video, v_lens.to(device), audio, tgt, t_lens.to(device))
                loss = args.ctc_weight * ctc + (1 - args.ctc_weight) * att
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d ctc %.3f att %.3f lr %.2e (%.1fs)", epoch, step,
                            len(train_loader), ctc.item(), att.item(), scheduler.get_last_lr()[0], time.time() - t0)

        wer = evaluate(model, valid_loader, sp, device)
        logger.info("epoch %d valid WER %.2f%%", epoch, 100 * wer)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_wer": min(best_wer, wer)}
            torch.save(state, ckpt_path)
            if wer < best_wer:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        best_wer = min(best_wer, wer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
