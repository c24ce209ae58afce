"""Fine-tune a pre-trained AV-HuBERT-style encoder with a CTC head on LRS3 (433h).

- the encoder is frozen for the first --freeze-steps updates (only the head trains)
- layerdrop and gradient checkpointing of the transformer layers for long clips
- modality dropout: the whole audio or video stream is zeroed for some utterances

torchrun --nproc_per_node=8 07_avhubert_ctc_finetune.py --pretrained ckpt/avhubert_base_pt.pt \
    --tsv-dir /data/lrs3/433h --label-dir /data/lrs3/433h --grad-ckpt
"""
import argparse
import contextlib
import math
import os
import random
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LETTERS = ["<blank>", "|"] + list("'ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def get_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--tsv-dir", required=True)
    p.add_argument("--label-dir", required=True)
    p.add_argument("--save-dir", default="exp/avhubert_ctc")
    p.add_argument("--max-updates", type=int, default=30000)
    p.add_argument("--freeze-steps", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--modality-drop", type=float, default=0.5)
    p.add_argument("--audio-drop", type=float, default=0.5)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--val-interval", type=int, default=2000)
    return p.parse_args()


class LRS3Stacked(Dataset):
    """<split>.tsv: id, video .npy (T x 88 x 88), fbank .npy (4T x 26); <split>.wrd: words."""

    def __init__(self, tsv_dir, label_dir, split):
        with open(os.path.join(tsv_dir, split + ".tsv")) as f:
            self.root = f.readline().strip()
            self.rows = [l.strip().split("\t") for l in f]
        with open(os.path.join(label_dir, split + ".wrd")) as f:
            self.words = [l.strip().upper() for l in f]
        assert len(self.rows) == len(self.words)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        _, vid, fb = self.rows[i][:3]
        video = torch.from_numpy(np.load(os.path.join(self.root, vid))).float() / 255.0
        fbank = torch.from_numpy(np.load(os.path.join(self.root, fb))).float()
        t = min(video.size(0), fbank.size(0) // 4)
        audio = fbank[: 4 * t].reshape(t, 104)
        audio = (audio - audio.mean(0)) / (audio.std(0) + 1e-5)
        text = "|".join(self.words[i].split())
        label = torch.tensor([LETTERS.index(c) for c in text if c in LETTERS], dtype=torch.long)
        return (video[:t] - 0.421) / 0.165, audio, label


def collate(batch):
    n = max(b[0].size(0) for b in batch)
    video = torch.zeros(len(batch), n, 88, 88)
    audio = torch.zeros(len(batch), n, 104)
    for i, (v, a, _) in enumerate(batch):
        video[i, : v.size(0)] = v
        audio[i, : a.size(0)] = a
    lens = torch.tensor([b[0].size(0) for b in batch])
    labels = [b[2] for b in batch]
    return video, audio, lens, torch.cat(labels), torch.tensor([l.numel() for l in labels])


class ResEncoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.frontend3d = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                        nn.BatchNorm3d(64), nn.PReLU(64), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r = torchvision.models.resnet18()
        self.trunk = nn.Sequential(r.layer1, r.layer2, r.layer3, r.layer4, nn.AdaptiveAvgPool2d(1))
        self.proj = nn.Linear(512, d)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.frontend3d(x.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return self.proj(self.trunk(x).flatten(1).view(b, t, -1))


class AVHubertEncoder(nn.Module):
    def __init__(self, d=768, layers=12, layerdrop=0.0):
        super().__init__()
        self.feature_extractor_video = ResEncoder(d)
        self.feature_extractor_audio = nn.Linear(104, d)
        self.post_extract_proj = nn.Linear(2 * d, d)
        self.pos_conv = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.layer_norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d, 12, 3072, 0.1, activation="gelu", batch_first=True)
            for _ in range(layers)])
        self.layerdrop = layerdrop
        self.grad_ckpt = False

    def forward(self, video, audio, pad_mask):
        fv = self.feature_extractor_video(video)
        fa = self.feature_extractor_audio(audio)
        x = self.post_extract_proj(torch.cat([fa, fv], dim=-1))
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        x = self.layer_norm(x)
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, None, pad_mask)
            else:
                x = layer(x, src_key_padding_mask=pad_mask)
        return x


class AVHubertCTC(nn.Module):
    def __init__(self, encoder, vocab, freeze_steps):
        super().__init__()
        self.encoder = encoder
        self.final_dropout = nn.Dropout(0.1)
        self.proj = nn.Linear(768, vocab)
        self.freeze_steps = freeze_steps

    def forward(self, video, audio, lens, num_updates):
        pad = torch.arange(video.size(1), device=video.device)[None] >= lens[:, None]
        ft = num_updates >= self.freeze_steps
        with torch.no_grad() if not ft else contextlib.nullcontext():
            x = self.encoder(video, audio, pad)
        return self.proj(self.final_dropout(x)).log_softmax(-1)


def drop_modality(video, audio, p_mod, p_audio):
    for i in range(video.size(0)):
        if random.random() < p_mod:
            if random.random() < p_audio:
                audio[i].zero_()
            else:
                video[i].zero_()
    return video, audio


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    errs = total = 0
    for video, audio, lens, labels, llens in loader:
        logp = net(video.to(device), audio.to(device), lens.to(device), num_updates=1 << 30)
        pred = logp.argmax(-1).cpu()
        off = 0
        for i in range(pred.size(0)):
            hyp = [LETTERS[c] for c in torch.unique_consecutive(pred[i, : lens[i]]).tolist() if c != 0]
            ref = [LETTERS[c] for c in labels[off:off + llens[i]].tolist()]
            off += llens[i].item()
            errs += editdistance.eval("".join(hyp).split("|"), "".join(ref).split("|"))
            total += len("".join(ref).split("|"))
    net.train()
    return errs / max(total, 1)


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(1337 + rank)
    torch.manual_seed(1337)

    encoder = AVHubertEncoder(layerdrop=cfg.layerdrop)
    state = torch.load(cfg.pretrained, map_location="cpu")
    missing, unexpected = encoder.load_state_dict(state["model"], strict=False)
    if rank == 0:
        print(f"loaded {cfg.pretrained}: {len(missing)} missing, {len(unexpected)} unexpected keys")
    encoder.grad_ckpt = cfg.grad_ckpt
    net = AVHubertCTC(encoder, len(LETTERS), cfg.freeze_steps).to(device)
    # frozen-encoder phase and layerdrop leave parameters without gradients
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    train_set = LRS3Stacked(cfg.tsv_dir, cfg.label_dir, "train")
    valid_set = LRS3Stacked(cfg.tsv_dir, cfg.label_dir, "valid")
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=6,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=8, num_workers=4, collate_fn=collate)

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    warm, hold = int(0.33 * cfg.max_updates), int(0.33 * cfg.max_updates)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warm if s < warm else (1.0 if s < warm + hold else
                                                        math.exp(math.log(0.05) * (s - warm - hold) / (cfg.max_updates - warm - hold))))
    if rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)

    updates, epoch, best_wer = 0, 0, 1e9
    t0 = time.time()
    while updates < cfg.max_updates:
        sampler.set_epoch(epoch)
        for video, audio, lens, labels, llens in train_loader:
            video, audio = drop_modality(video, audio, cfg.modality_drop, cfg.audio_drop)
            video, audio = video.to(device, non_blocking=True), audio.to(device, non_blocking=True)
            lens, labels, llens = lens.to(device), labels.to(device), llens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp = model(video, audio, lens, updates)
            loss = F.ctc_loss(logp.float().transpose(0, 1), labels, lens, llens, zero_infinity=True)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            updates += 1

            if rank == 0 and updates % 100 == 0:
                print(f"upd {updates} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.2f}s/upd", flush=True)
                t0 = time.time()
            if updates % cfg.val_interval == 0:
                if rank == 0:
                    wer = validate(net, valid_loader, device)
                    print(f"upd {updates} valid WER {100 * wer:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "updates": updates}, os.path.join(cfg.save_dir, "checkpoint_last.pt"))
                    if wer < best_wer:
                        best_wer = wer
                        torch.save({"model": net.state_dict(), "updates": updates}, os.path.join(cfg.save_dir, "checkpoint_best.pt"))
                dist.barrier()
            if updates >= cfg.max_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
