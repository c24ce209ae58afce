"""Audio-ConvNeXt: ConvNeXt-Tiny on log-mels for AudioSet tagging, attention pooling head.

    torchrun --nproc_per_node=8 15_audioset_convnext.py --train-h5 /data/as/bal_unbal_train.h5 \
        --eval-h5 /data/as/eval.h5 --save-dir runs/convnext_tiny
"""
import argparse
import logging
import math
import os
import random

import h5py
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import norm
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.transforms import FrequencyMasking, MelSpectrogram, TimeMasking

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
SAMPLE_RATE = 32000
logger = logging.getLogger(__name__)


class H5Waveforms(Dataset):
    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as f:
            self.length = len(f["target"])
        self.f = None

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        wav = torch.from_numpy(self.f["waveform"][i].astype(np.float32) / 32768.0)
        target = torch.from_numpy(self.f["target"][i].astype(np.float32))
        return wav, target


class MelFrontend(nn.Module):
    def __init__(self, n_mels=224):
        super().__init__()
        self.mel = MelSpectrogram(SAMPLE_RATE, n_fft=1024, hop_length=320, n_mels=n_mels, f_min=50, f_max=14000)
        self.fmask = FrequencyMasking(48, iid_masks=True)
        self.tmask = TimeMasking(160, iid_masks=True)

    @torch.no_grad()
    def forward(self, wav, augment=False):
        x = torch.log10(self.mel(wav).clamp(min=1e-10)).unsqueeze(1)   # (B, 1, F, T)
        x = (x + 2.0) / 2.5
        if augment:
            x = self.tmask(self.fmask(x))
        return x


class AudioConvNeXt(nn.Module):
    def __init__(self, num_classes=527, drop_path=0.1):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny", pretrained=False, in_chans=1, num_classes=0,
                                          global_pool="", drop_path_rate=drop_path)
        c = self.backbone.num_features
        self.att = nn.Linear(c, num_classes)
        self.cla = nn.Linear(c, num_classes)

    def forward(self, x, return_frames=False):
        h = self.backbone(x)                  # (B, C, F', T')
        h = h.mean(2).transpose(1, 2)         # (B, T', C)
        att = torch.softmax(torch.clamp(self.att(h), -10, 10), dim=1)
        cla = self.cla(h)
        clip_logits = (att * cla).sum(1)
        if return_frames:
            return clip_logits, torch.sigmoid(cla)
        return clip_logits


def dprime(auc):
    return math.sqrt(2.0) * norm.ppf(auc)


@torch.no_grad()
def evaluate(model, frontend, loader, n_items):
    model.eval()
    preds, targs = [], []
    for wav, y in loader:
        logits = model(frontend(wav.to(DEVICE)))
        preds.append(torch.sigmoid(logits))
        targs.append(y.to(DEVICE))
    p, y = torch.cat(preds), torch.cat(targs)
    world = dist.get_world_size()
    gp = [torch.empty_like(p) for _ in range(world)]
    gy = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    # DistributedSampler(shuffle=False) hands out index r, r+W, r+2W, ... to rank r: interleave back
    p = torch.stack(gp, dim=1).reshape(-1, p.size(1))[:n_items].cpu().numpy()
    y = torch.stack(gy, dim=1).reshape(-1, y.size(1))[:n_items].cpu().numpy()
    keep = y.sum(0) > 0
    ap = average_precision_score(y[:, keep], p[:, keep], average=None)
    auc = roc_auc_score(y[:, keep], p[:, keep], average=None)
    return float(ap.mean()), float(auc.mean()), float(dprime(auc.mean()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-h5", required=True)
    parser.add_argument("--eval-h5", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=4e-4, help="for a global batch of 256")
    parser.add_argument("--mixup-alpha", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=3407)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO if rank == 0 else logging.WARNING)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set, eval_set = H5Waveforms(args.train_h5), H5Waveforms(args.eval_h5)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_set, batch_size=32, sampler=eval_sampler, num_workers=args.workers)

    frontend = MelFrontend().to(DEVICE)
    model = AudioConvNeXt().to(DEVICE)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr)
    steps = args.epochs * len(train_loader)
    warmup = len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            x = frontend(wav, augment=True)
            lam = np.random.beta(args.mixup_alpha, args.mixup_alpha)
            perm = torch.randperm(x.size(0), device=x.device)
            x, y = lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % 500 == 0:
                logger.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        mAP, mAUC, dp = evaluate(model.module, frontend, eval_loader, len(eval_set))
        logger.info("epoch %d: mAP %.4f mAUC %.4f d' %.3f", epoch, mAP, mAUC, dp)
        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "mAP": mAP}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if mAP > best:
                best = mAP
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
