#!/usr/bin/env python3
"""Quantization-aware fine-tuning of a MobileNetV2-style KWS model for int8 MCU deployment.

Starts from a float checkpoint, fuses conv/bn/relu, inserts fake-quant with the
qnnpack config, fine-tunes for a few epochs on 8 GPUs, freezes observers and BN
statistics late in training, then converts the best checkpoint to a real int8
TorchScript model.

    torchrun --nproc_per_node=8 06_mobilenet_qat_export.py \
        --float-ckpt exp/mbv2_float/best.pt --data /data/kws_feats --out exp/mbv2_qat
"""
import argparse
import copy
import logging
import os

import numpy as np
import torch
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


class FeatureShards(Dataset):
    """Precomputed 49x10 MFCC features stored as .npy (features, labels) per split."""

    def __init__(self, root, split):
        self.x = np.load(os.path.join(root, f"{split}_x.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_y.npy"))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.float32)).unsqueeze(0), int(self.y[i])


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout, k=3, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if relu:
            layers.append(nn.ReLU(inplace=False))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(ConvBNReLU(cin, hid, 1), ConvBNReLU(hid, hid, 3, stride, groups=hid),
                                  ConvBNReLU(hid, cout, 1, relu=False))
        self.skip_add = nn.quantized.FloatFunctional()

    def forward(self, x):
        return self.skip_add.add(x, self.conv(x)) if self.use_res else self.conv(x)


class KwsMobileNet(nn.Module):
    def __init__(self, n_classes=12, width=32):
        super().__init__()
        self.quant = tq.QuantStub()
        self.features = nn.Sequential(
            ConvBNReLU(1, width, 3, 2),
            InvertedResidual(width, 16, 1, 1),
            InvertedResidual(16, 24, 2, 4), InvertedResidual(24, 24, 1, 4),
            InvertedResidual(24, 32, 2, 4), InvertedResidual(32, 32, 1, 4), InvertedResidual(32, 32, 1, 4),
            InvertedResidual(32, 64, 1, 4), InvertedResidual(64, 64, 1, 4),
            ConvBNReLU(64, 128, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, n_classes)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        x = self.pool(self.features(x)).flatten(1)
        return self.dequant(self.fc(x))

    def fuse_model(self):
        for m in self.modules():
            if isinstance(m, ConvBNReLU):
                tq.fuse_modules_qat(m, ["0", "1", "2"] if len(m) == 3 else ["0", "1"], inplace=True)


def build_qat_model(n_classes, float_state=None):
    model = KwsMobileNet(n_classes)
    if float_state is not None:
        model.load_state_dict(float_state)
    model.train()
    model.fuse_model()
    model.qconfig = tq.get_default_qat_qconfig("qnnpack")
    tq.prepare_qat(model, inplace=True)
    return model


def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t[0] += (model(x).argmax(1) == y).sum()
            t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def export_int8(ckpt_path, n_classes, out_path):
    torch.backends.quantized.engine = "qnnpack"
    qat = build_qat_model(n_classes)
    qat.load_state_dict(torch.load(ckpt_path, map_location="cpu")["model"])
    qat.eval()
    int8 = tq.convert(qat.cpu(), inplace=False)
    scripted = torch.jit.script(int8)
    scripted.save(out_path)
    return int8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--float-ckpt", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="exp/mbv2_qat")
    ap.add_argument("--n-classes", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--freeze-observer-epoch", type=int, default=4)
    ap.add_argument("--freeze-bn-epoch", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")

    train_set, val_set = FeatureShards(args.data, "train"), FeatureShards(args.data, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=512, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, pin_memory=True)

    float_state = torch.load(args.float_ckpt, map_location="cpu")["model"]
    model = build_qat_model(args.n_classes, float_state).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    os.makedirs(args.out, exist_ok=True)
    last_path, best_path = os.path.join(args.out, "last.pt"), os.path.join(args.out, "best.pt")
    start, best = 0, 0.0
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start, best = ckpt["epoch"] + 1, ckpt["best"]
        logger.info("resumed at epoch %d (best %.4f)", start, best)

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        if epoch >= args.freeze_observer_epoch:
            model.apply(tq.disable_observer)
        if epoch >= args.freeze_bn_epoch:
            model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i % 100 == 0:
                logger.info("epoch %d iter %d loss %.4f", epoch, i, loss.item())
        sched.step()

        acc = evaluate(model, val_loader, device)
        logger.info("epoch %d fake-quant val acc %.4f", epoch, acc)
        if rank == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, acc)}
            torch.save(state, last_path)
            if acc > best:
                torch.save(state, best_path)
        best = max(best, acc)
        dist.barrier()

    if rank == 0:
        int8 = export_int8(best_path, args.n_classes, os.path.join(args.out, "kws_int8.ptl"))
        logger.info("int8 model exported, %d bytes of weights",
                    sum(p.numel() for p in int8.state_dict().values() if torch.is_tensor(p)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
