"""ESC-50 5-fold cross-validation with a ResNet-18 on GPU log-mels (one DDP job runs all folds).

    torchrun --nproc_per_node=4 06_esc50_resnet_cv.py --root /data/ESC-50-master --init ckpt/resnet18_imagenet.pth
"""
import argparse
import json
import os
import time
from collections import OrderedDict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--init", default="", help="ImageNet ResNet-18 weights (may come from a DDP run)")
    ap.add_argument("--folds", default="1,2,3,4,5")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=2e-4, help="lr for a global batch of 64")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="exp/esc50_resnet18")
    return ap.parse_args()


class ESC50Wave(Dataset):
    def __init__(self, root, folds, sr=44100, train=False):
        meta = pd.read_csv(os.path.join(root, "meta/esc50.csv"))
        meta = meta[meta.fold.isin(folds)]
        self.files = [os.path.join(root, "audio", f) for f in meta.filename]
        self.y = meta.target.tolist()
        self.sr, self.train = sr, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        assert sr == self.sr
        wav = wav.mean(0)
        if self.train:
            shift = np.random.randint(-self.sr // 2, self.sr // 2)
            wav = torch.roll(wav, shift)
        return wav, self.y[i]


class MelFrontend(nn.Module):
    def __init__(self, sr=44100):
        super().__init__()
        self.spec = torchaudio.transforms.MelSpectrogram(sr, n_fft=2048, hop_length=512, n_mels=128,
                                                         f_min=20, f_max=sr // 2)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(24, iid_masks=True)
        self.time_mask = torchaudio.transforms.TimeMasking(48, iid_masks=True)

    @torch.no_grad()
    def forward(self, wav, augment=False):
        x = (self.spec(wav) + 1e-8).log().unsqueeze(1)          # B,1,F,T
        x = (x - x.mean(dim=(2, 3), keepdim=True)) / (x.std(dim=(2, 3), keepdim=True) + 1e-5)
        if augment:
            x = self.time_mask(self.freq_mask(x))
        return x


def make_model(init_path, num_classes=50):
    net = torchvision.models.resnet18(weights=None)
    if init_path:
        sd = torch.load(init_path, map_location="cpu")
        sd = sd.get("state_dict", sd)
        sd = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in sd.items())
        # average RGB filters into a single input channel
        sd["conv1.weight"] = sd["conv1.weight"].mean(1, keepdim=True)
        sd = {k: v for k, v in sd.items() if not k.startswith("fc.")}
        net.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        net.load_state_dict(sd, strict=False)
    else:
        net.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    net.fc = nn.Linear(net.fc.in_features, num_classes)
    return net


@torch.no_grad()
def evaluate(net, frontend, loader, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    for wav, y in loader:
        logits = net(frontend(wav.to(device)))
        acc[0] += (logits.argmax(-1).cpu() == y).sum().item()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def train_fold(args, fold, rank, world, local_rank, device):
    train_folds = [f for f in range(1, 6) if f != fold]
    train_ds = ESC50Wave(args.root, train_folds, train=True)
    test_ds = ESC50Wave(args.root, [fold])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=fold, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    # each rank evaluates its own stride of the test fold; counts are summed, nothing is padded
    test_idx = list(range(rank, len(test_ds), world))
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, test_idx), batch_size=50, num_workers=args.workers)

    torch.manual_seed(fold)
    net = make_model(args.init)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank], output_device=local_rank)
    frontend = MelFrontend().to(device)

    lr = args.base_lr * args.batch_size * world / 64
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)
    best, fold_dir = 0.0, os.path.join(args.out, f"fold{fold}")
    if rank == 0:
        os.makedirs(fold_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        loss_sum = torch.zeros((), device=device)
        for wav, y in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = frontend(wav, augment=True)
            loss = F.cross_entropy(net(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            acc = evaluate(net.module, frontend, test_dl, device)
            if rank == 0:
                print(f"[fold {fold}] epoch {epoch:3d} loss {loss_sum.item() / len(train_dl):.4f} acc {acc:.4f}",
                      flush=True)
                if acc > best:
                    torch.save({"model": net.module.state_dict(), "epoch": epoch, "acc": acc},
                               os.path.join(fold_dir, "best.pt"))
            best = max(best, acc)
    dist.barrier()
    # report the accuracy of the selected checkpoint, reloaded on every rank
    state = torch.load(os.path.join(fold_dir, "best.pt"), map_location=device)
    net.module.load_state_dict(state["model"])
    final = evaluate(net.module, frontend, test_dl, device)
    del net, opt
    torch.cuda.empty_cache()
    return final


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    results = {}
    for fold in [int(f) for f in args.folds.split(",")]:
        t0 = time.time()
        results[fold] = train_fold(args, fold, rank, world, local_rank, device)
        if rank == 0:
            print(f"fold {fold}: {results[fold]:.4f} ({(time.time() - t0) / 60:.1f} min)", flush=True)

    if rank == 0:
        results["mean"] = float(np.mean(list(results.values())))
        print(json.dumps(results, indent=2))
        with open(os.path.join(args.out, "cv_results.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
