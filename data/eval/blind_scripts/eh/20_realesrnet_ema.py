"""Real-ESRNet x2 (L1 stage) for the tele-camera preset, with generator EMA and gradient accumulation.

The global batch is fixed (64) whatever the number of GPUs: per-GPU batch x GPUs x accumulation steps.
A file index of the HR sub-images is built once (rank 0) and shared through the dataset folder.

    torchrun --nnodes=1 --nproc_per_node=4 20_realesrnet_ema.py --hr-root /data/tele_hr_sub --val-root /data/tele_val
"""
import argparse
import contextlib
import copy
import json
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ------------------------------------------------------------------------------------- data
def build_index(hr_root, index_path):
    files = []
    for dp, _, fs in os.walk(hr_root):
        files += [os.path.relpath(os.path.join(dp, f), hr_root) for f in fs if f.lower().endswith(".png")]
    files.sort()
    tmp = f"{index_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(files, f)
    os.replace(tmp, index_path)


def degrade(hr, scale):
    img = hr.astype(np.float32) / 255.0
    sigma = np.random.uniform(0.2, 2.0)
    img = cv2.GaussianBlur(img, (0, 0), sigma)
    f = np.random.uniform(0.5, 1.0)
    img = cv2.resize(img, None, fx=f, fy=f, interpolation=random.choice([cv2.INTER_AREA, cv2.INTER_CUBIC]))
    img = img + np.random.randn(*img.shape).astype(np.float32) * np.random.uniform(0, 8) / 255.0
    img = (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
    _, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, np.random.randint(40, 95)])
    img = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    h, w = hr.shape[:2]
    return cv2.resize(img, (w // scale, h // scale), interpolation=cv2.INTER_CUBIC)


class DegradedHR(Dataset):
    def __init__(self, hr_root, files, scale=2, gt_size=256):
        self.hr_root, self.files, self.scale, self.gt_size = hr_root, files, scale, gt_size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        hr = cv2.imread(os.path.join(self.hr_root, self.files[i]), cv2.IMREAD_COLOR)
        y = random.randint(0, hr.shape[0] - self.gt_size)
        x = random.randint(0, hr.shape[1] - self.gt_size)
        hr = np.ascontiguousarray(hr[y:y + self.gt_size, x:x + self.gt_size])
        if random.random() < 0.5:
            hr = np.ascontiguousarray(hr[:, ::-1])
        lq = degrade(hr, self.scale)
        t = lambda a: torch.from_numpy(a[:, :, ::-1].transpose(2, 0, 1).copy()).float() / 255.0
        return t(lq), t(hr)


def worker_init_fn(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)
    random.seed(seed)


# ------------------------------------------------------------------------------------- model
class RDB(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(nf + i * gc, gc, 3, 1, 1) for i in range(4))
        self.conv_out = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)

    def forward(self, x):
        feats = [x]
        for c in self.convs:
            feats.append(F.leaky_relu(c(torch.cat(feats, 1)), 0.2))
        return self.conv_out(torch.cat(feats, 1)) * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.body = nn.Sequential(RDB(nf), RDB(nf), RDB(nf))

    def forward(self, x):
        return self.body(x) * 0.2 + x


class RRDBNetX2(nn.Module):
    """x2 via pixel-unshuffle of the input, as in Real-ESRGAN."""

    def __init__(self, nf=64, nb=23):
        super().__init__()
        self.conv_first = nn.Conv2d(3 * 4, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        f = self.conv_first(F.pixel_unshuffle(x, 2))
        f = f + self.conv_body(self.body(f))
        f = F.leaky_relu(self.conv_up1(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        f = F.leaky_relu(self.conv_up2(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(f), 0.2))


class EMA:
    def __init__(self, net, decay=0.999):
        self.decay = decay
        self.net = copy.deepcopy(net).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, net):
        for e, p in zip(self.net.parameters(), net.parameters()):
            e.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        for e, b in zip(self.net.buffers(), net.buffers()):
            e.copy_(b)


# ------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hr-root", required=True)
    ap.add_argument("--val-root", required=True, help="lq/ and gt/ folders: 20 fixed-degradation crops")
    ap.add_argument("--out", default="experiments/realesrnet_x2_tele")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--batch-per-gpu", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    assert args.global_batch % (args.batch_per_gpu * world) == 0, "global batch must split evenly"
    accum = args.global_batch // (args.batch_per_gpu * world)

    index_path = os.path.join(args.hr_root, "meta_index.json")
    if rank == 0 and not os.path.isfile(index_path):
        build_index(args.hr_root, index_path)
    dist.barrier()
    with open(index_path) as f:
        files = json.load(f)

    ds = DegradedHR(args.hr_root, files)
    sampler = DistributedSampler(ds, shuffle=True, seed=2023)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True, worker_init_fn=worker_init_fn)

    net = RRDBNetX2().to(device)
    ema = EMA(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [200000], 0.5)
    scaler = torch.cuda.amp.GradScaler()
    step = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["params"])
        ema.net.load_state_dict(ck["params_ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        step = ck["step"]
    model = DDP(net, device_ids=[local_rank])

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(args.out, "models"), exist_ok=True)
    val_names = sorted(os.listdir(os.path.join(args.val_root, "gt")))

    steps_per_epoch = len(loader) // accum
    epoch = step // steps_per_epoch
    while step < args.iters:
        sampler.set_epoch(epoch)
        data_iter = iter(loader)
        for _ in range(steps_per_epoch):
            for micro in range(accum):
                lq, gt = next(data_iter)
                lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
                sync_ctx = model.no_sync() if micro < accum - 1 else contextlib.nullcontext()
                with sync_ctx:
                    with torch.autocast("cuda", dtype=torch.float16):
                        out = model(lq)
                    loss = F.l1_loss(out.float(), gt) / accum
                    scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            ema.update(net)
            step += 1

            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/l1", loss.item() * accum, step)
                print(f"step {step} l1 {loss.item() * accum:.4f} accum {accum}", flush=True)

            if step % 5000 == 0:
                if rank == 0:
                    psnrs = []
                    with torch.no_grad():
                        for n in val_names:
                            lq_v = cv2.imread(os.path.join(args.val_root, "lq", n))[:, :, ::-1]
                            gt_v = cv2.imread(os.path.join(args.val_root, "gt", n))[:, :, ::-1]
                            inp = torch.from_numpy(lq_v.transpose(2, 0, 1).copy()).float().div(255)[None].to(device)
                            sr = ema.net(inp).clamp(0, 1)[0].permute(1, 2, 0).cpu().numpy()
                            sr = (sr * 255).round()
                            mse = np.mean((sr[2:-2, 2:-2] - gt_v[2:-2, 2:-2].astype(np.float64)) ** 2)
                            psnrs.append(10 * np.log10(255.0 ** 2 / mse))
                    writer.add_scalar("val/psnr_ema", float(np.mean(psnrs)), step)
                    print(f"[val] step {step} EMA PSNR {np.mean(psnrs):.3f}", flush=True)
                    torch.save({"params": net.state_dict(), "params_ema": ema.net.state_dict(),
                                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                "scaler": scaler.state_dict(), "step": step},
                               os.path.join(args.out, "models", f"net_g_{step}.pth"))
                dist.barrier()
            if step >= args.iters:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
