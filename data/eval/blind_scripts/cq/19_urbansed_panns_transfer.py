"""URBAN-SED sound event detection by transfer from an AudioSet-pretrained PANNs Cnn14 backbone.

Backbone conv blocks come from Cnn14_mAP=0.431.pth (time pooling reduced so frames stay at 40 ms),
a BiGRU + frame classifier is trained on top; clip predictions are the max over frames.

    torchrun --nproc_per_node=4 19_urbansed_panns_transfer.py --root /data/URBAN-SED_v2.0.0 \
        --panns ckpt/Cnn14_mAP=0.431.pth --out exp/urbansed_cnn14gru
"""
import argparse
import glob
import os
import time

import librosa
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking

CLASSES = ["air_conditioner", "car_horn", "children_playing", "dog_bark", "drilling",
           "engine_idling", "gun_shot", "jackhammer", "siren", "street_music"]
SR, HOP = 32000, 320
OUT_HOP_S = 0.04            # 4x time pooling of 10 ms frames
N_OUT = 250                 # 10 s


class UrbanSED(Dataset):
    def __init__(self, root, split):
        self.wavs = sorted(glob.glob(os.path.join(root, "audio", split, "*.wav")))
        self.ann_dir = os.path.join(root, "annotations", split)

    def __len__(self):
        return len(self.wavs)

    def __getitem__(self, i):
        wav, _ = librosa.load(self.wavs[i], sr=SR, mono=True)
        wav = np.pad(wav, (0, max(0, 10 * SR - len(wav))))[: 10 * SR]
        y = np.zeros((N_OUT, len(CLASSES)), np.float32)
        ann = os.path.join(self.ann_dir, os.path.basename(self.wavs[i]).replace(".wav", ".txt"))
        with open(ann) as f:
            for line in f:
                on, off, lab = line.split()
                y[int(float(on) / OUT_HOP_S): int(np.ceil(float(off) / OUT_HOP_S)), CLASSES.index(lab)] = 1
        return torch.from_numpy(wav.astype(np.float32)), torch.from_numpy(y)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

    def forward(self, x, pool):
        x = F.relu_(self.bn2(self.conv2(F.relu_(self.bn1(self.conv1(x))))))
        return F.avg_pool2d(x, pool)


class Cnn14Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(64)
        ch = [1, 64, 128, 256, 512, 1024, 2048]
        for k in range(6):
            setattr(self, f"conv_block{k + 1}", ConvBlock(ch[k], ch[k + 1]))
        # time pooling only in the first two blocks -> 40 ms output frames
        self.pools = [(2, 2), (2, 2), (1, 2), (1, 2), (1, 2), (1, 2)]

    def forward(self, x):                         # (B, 1, T, 64)
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        for k, pool in enumerate(self.pools):
            x = F.dropout(getattr(self, f"conv_block{k + 1}")(x, pool), 0.2, self.training)
        return x.mean(3).transpose(1, 2)          # (B, T/4, 2048)


class SEDModel(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.backbone = Cnn14Backbone()
        self.proj = nn.Linear(2048, 512)
        self.gru = nn.GRU(512, 256, batch_first=True, bidirectional=True)
        self.frame_fc = nn.Linear(512, n_classes)

    def load_panns(self, path):
        sd = torch.load(path, map_location="cpu")["model"]
        sd = {k: v for k, v in sd.items() if k.startswith(("bn0.", "conv_block"))}
        self.backbone.load_state_dict(sd, strict=True)

    def forward(self, x):
        h = F.relu(self.proj(self.backbone(x)))
        h, _ = self.gru(F.dropout(h, 0.3, self.training))
        frame_logits = self.frame_fc(h)           # (B, T', C)
        return frame_logits, frame_logits.max(1).values


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=1024, hop_length=HOP, n_mels=64, f_min=50, f_max=14000)
        self.db = AmplitudeToDB(top_db=None)
        self.fm, self.tm = FrequencyMasking(8, iid_masks=True), TimeMasking(40, iid_masks=True)

    @torch.no_grad()
    def forward(self, wav, augment):
        x = self.db(self.mel(wav))[..., : N_OUT * 4]
        if augment:
            x = self.tm(self.fm(x))
        return x.transpose(1, 2).unsqueeze(1)


@torch.no_grad()
def validate(model, frontend, loader, device, thr=0.5):
    """Segment-based (1 s) F1 / error rate counts, summed over ranks."""
    model.eval()
    c = torch.zeros(5, device=device)             # tp, fp, fn, S + D + I (= max(fp, fn) per segment), n_ref
    for wav, y in loader:
        frame_logits, _ = model(frontend(wav.to(device), augment=False))
        p = (torch.sigmoid(frame_logits) > thr).float()
        y = y.to(device)
        p = p.view(p.size(0), 10, 25, -1).amax(2)
        t = y.view(y.size(0), 10, 25, -1).amax(2)
        tp, fp, fn = (p * t).sum(), (p * (1 - t)).sum(), ((1 - p) * t).sum()
        fp_s, fn_s = (p * (1 - t)).sum(-1), ((1 - p) * t).sum(-1)
        c += torch.stack([tp, fp, fn, torch.maximum(fp_s, fn_s).sum(), t.sum()])
    dist.all_reduce(c)
    f1 = (2 * c[0] / (2 * c[0] + c[1] + c[2]).clamp(min=1)).item()
    er = (c[3] / c[4].clamp(min=1)).item()
    return f1, er


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--panns", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="head lr for a global batch of 64")
    ap.add_argument("--backbone-lr-mult", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = UrbanSED(args.root, "train"), UrbanSED(args.root, "validate")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 32, sampler=list(range(rank, len(val_ds), world)), num_workers=args.workers)

    model = SEDModel(len(CLASSES))
    model.load_panns(args.panns)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    frontend = Frontend().to(device)

    lr = args.lr * world * args.batch_size / 64
    backbone_params = list(model.backbone.parameters())
    backbone_ids = {id(p) for p in backbone_params}
    head_params = [p for p in model.parameters() if id(p) not in backbone_ids]
    opt = torch.optim.Adam([{"params": backbone_params, "lr": lr * args.backbone_lr_mult},
                            {"params": head_params, "lr": lr}])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)
    pos_weight = torch.full((len(CLASSES),), 2.0, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            frame_logits, clip_logits = model(frontend(wav, augment=True))
            loss = F.binary_cross_entropy_with_logits(frame_logits, y, pos_weight=pos_weight) \
                + 0.5 * F.binary_cross_entropy_with_logits(clip_logits, y.amax(1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()

        f1, er = validate(model.module, frontend, val_dl, device)
        sched.step(f1)
        if rank == 0:
            print(f"epoch {epoch}: segment F1 {f1:.4f} ER {er:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "f1": f1}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if f1 > best_f1:
                best_f1 = f1
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
