"""AudioSet-20K (balanced subset) with a ViT-Small over 128x1024 log-mel patches (AST-like, no overlap).

Step-based schedule with periodic evaluation (mAP / AUC / d') and TensorBoard logging.

    torchrun --nproc_per_node=8 17_audioset20k_vit_small.py --train data/as20k_train.tsv \
        --val data/as_eval.tsv --logdir runs/vits_as20k
"""
import argparse
import math
import os
import time

import numpy as np
import soundfile as sf
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
from torch.utils.tensorboard import SummaryWriter
from torchaudio.transforms import FrequencyMasking, MelSpectrogram, TimeMasking


class TsvClips(Dataset):
    """TSV: wav_path<TAB>comma separated class indices."""

    def __init__(self, tsv, n_classes=527, sr=16000, seconds=10.24):
        with open(tsv) as f:
            self.items = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        self.n_classes, self.n = n_classes, int(sr * seconds)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, labels = self.items[i]
        wav, _ = sf.read(path, dtype="float32")
        if wav.ndim > 1:
            wav = wav.mean(1)
        x = np.zeros(self.n, np.float32)
        x[: min(self.n, len(wav))] = wav[: self.n]
        y = np.zeros(self.n_classes, np.float32)
        y[[int(c) for c in labels.split(",")]] = 1.0
        return torch.from_numpy(x), torch.from_numpy(y), i


class Spec(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=128, f_min=20, f_max=8000)
        self.aug = nn.Sequential(FrequencyMasking(30, iid_masks=True), TimeMasking(200, iid_masks=True))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = (torch.log(self.mel(wav) + 1e-6)[..., :1024] + 4.27) / 9.14
        x = x.unsqueeze(1)
        return self.aug(x) if augment else x


def gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, spec, loader, n_total, device):
    model.eval()
    P, Y, I = [], [], []
    for wav, y, idx in loader:
        P.append(torch.sigmoid(model(spec(wav.to(device), augment=False)).float()))
        Y.append(y.to(device))
        I.append(idx.to(device))
    P, Y, I = gather_cat(torch.cat(P)), gather_cat(torch.cat(Y)), gather_cat(torch.cat(I))
    # DistributedSampler pads with a few repeated clips: keep the first occurrence of each index
    _, first = np.unique(I.cpu().numpy(), return_index=True)
    assert len(first) == n_total
    p, y = P.cpu().numpy()[first], Y.cpu().numpy()[first]
    cols = y.sum(0) > 0
    ap = average_precision_score(y[:, cols], p[:, cols], average=None)
    auc = roc_auc_score(y[:, cols], p[:, cols], average=None)
    model.train()
    return float(ap.mean()), float(auc.mean()), float(norm.ppf(auc.mean()) * math.sqrt(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--steps", type=int, default=60_000)
    ap.add_argument("--eval-every", type=int, default=2_000)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 256")
    ap.add_argument("--warmup", type=int, default=3_000)
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_set, val_set = TsvClips(args.train), TsvClips(args.val)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=(128, 1024), in_chans=1,
                              num_classes=527, drop_path_rate=0.1)
    model = DDP(model.to(device), device_ids=[local_rank])
    spec = Spec().to(device)
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step, epoch, best = 0, 0, 0.0
    t0 = time.time()
    model.train()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for wav, y, _ in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = spec(wav, augment=True)
            if np.random.rand() < args.mixup:
                lam = float(np.random.beta(10, 10))
                perm = torch.randperm(x.size(0), device=device)
                x, y = lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    writer.add_scalar("train/steps_per_s", 100 / (time.time() - t0), step)
                t0 = time.time()

            if step % args.eval_every == 0 and rank == 0:
                mAP, auc, dp = evaluate(model.module, spec, val_loader, len(val_set), device)
                writer.add_scalar("val/mAP", mAP, step)
                writer.add_scalar("val/AUC", auc, step)
                writer.add_scalar("val/dprime", dp, step)
                print(f"step {step}: mAP {mAP:.4f} AUC {auc:.4f} d' {dp:.3f}", flush=True)
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(state, os.path.join(args.logdir, "last.pt"))
                if mAP > best:
                    best = mAP
                    torch.save(state, os.path.join(args.logdir, "best.pt"))
            if step >= args.steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
