"""MobileFaceNet + CosFace on MS1M-ArcFace, with ONNX export of the best model for the
edge SDK at the end of training.

    torchrun --nproc_per_node=4 11_mobilefacenet_export.py --rec /data/faces_emore --epochs 18
"""
import argparse
import numbers
import os
import pickle
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout, k=1, s=1, p=0, groups=1, linear=False):
        layers = [nn.Conv2d(cin, cout, k, s, p, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if not linear:
            layers.append(nn.PReLU(cout))
        super().__init__(*layers)


class DepthWise(nn.Module):
    def __init__(self, cin, cout, s, groups, residual=False):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBlock(cin, groups), ConvBlock(groups, groups, 3, s, 1, groups=groups),
            ConvBlock(groups, cout, linear=True))

    def forward(self, x):
        return x + self.layers(x) if self.residual else self.layers(x)


class MobileFaceNet(nn.Module):
    def __init__(self, emb=512):
        super().__init__()
        self.body = nn.Sequential(
            ConvBlock(3, 64, 3, 2, 1), ConvBlock(64, 64, 3, 1, 1, groups=64),
            DepthWise(64, 64, 2, 128), *[DepthWise(64, 64, 1, 128, True) for _ in range(4)],
            DepthWise(64, 128, 2, 256), *[DepthWise(128, 128, 1, 256, True) for _ in range(6)],
            DepthWise(128, 128, 2, 512), *[DepthWise(128, 128, 1, 256, True) for _ in range(2)],
            ConvBlock(128, 512), ConvBlock(512, 512, 7, 1, 0, groups=512, linear=True))
        self.fc = nn.Linear(512, emb, bias=False)
        self.bn = nn.BatchNorm1d(emb)

    def forward(self, x):
        return self.bn(self.fc(self.body(x).flatten(1)))


class CosMarginProduct(nn.Module):
    def __init__(self, emb, classes, s=64.0, m=0.4):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.randn(classes, emb) * 0.01)

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.weight))
        return self.s * (cos - self.m * F.one_hot(y, cos.size(1)))


class Recognizer(nn.Module):
    def __init__(self, num_classes, emb=512):
        super().__init__()
        self.backbone = MobileFaceNet(emb)
        self.head = CosMarginProduct(emb, num_classes)

    def forward(self, x, y):
        return self.head(self.backbone(x), y)


class FaceRec(Dataset):
    def __init__(self, root):
        self.imgrec = mx.recordio.MXIndexedRecordIO(f"{root}/train.idx", f"{root}/train.rec", "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        self.idx = np.arange(1, int(header.label[0]))
        self.tf = transforms.Compose([transforms.ToPILImage(), transforms.RandomHorizontalFlip(),
                                      transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        header, img = mx.recordio.unpack(self.imgrec.read_idx(int(self.idx[i])))
        lab = header.label if isinstance(header.label, numbers.Number) else header.label[0]
        return self.tf(mx.image.imdecode(img).asnumpy()), int(lab)


def lfw_accuracy(backbone, bin_path, device):
    bins, issame = pickle.load(open(bin_path, "rb"), encoding="bytes")
    imgs = torch.stack([torch.from_numpy(mx.image.imdecode(b).asnumpy()).permute(2, 0, 1) for b in bins])
    imgs = imgs.float().div(127.5).sub(1.0)
    backbone.eval()
    with torch.no_grad():
        emb = torch.cat([F.normalize(backbone(c.to(device)) + backbone(c.flip(3).to(device))) for c in imgs.split(400)])
    backbone.train()
    sim = (emb[0::2] * emb[1::2]).sum(1).cpu().numpy()
    issame = np.array(issame)
    return max(np.mean((sim > t) == issame) for t in np.arange(-0.2, 0.8, 0.002))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/data/faces_emore")
    ap.add_argument("--num-classes", type=int, default=85742)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=18)
    ap.add_argument("--out", default="work_dirs/mbf_cosface")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    ds = FaceRec(args.rec)
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    model = DDP(Recognizer(args.num_classes).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x, y), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"{epoch}:{it}/{len(loader)} loss={loss.item():.3f} lr={sched.get_last_lr()[0]:.4f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
        if rank == 0:
            acc = lfw_accuracy(model.module.backbone, os.path.join(args.rec, "lfw.bin"), device)
            print(f"epoch {epoch} lfw {acc:.4f}", flush=True)
            ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "lfw": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if acc >= best:
                best = acc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        ck = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
        export = Recognizer(args.num_classes)
        export.load_state_dict(ck["model"])
        net = export.backbone.eval()
        torch.onnx.export(net, torch.randn(1, 3, 112, 112), os.path.join(args.out, "mbf.onnx"),
                          input_names=["data"], output_names=["fc1"], opset_version=13,
                          dynamic_axes={"data": {0: "batch"}, "fc1": {0: "batch"}})
        print(f"exported best model (lfw {ck['lfw']:.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
