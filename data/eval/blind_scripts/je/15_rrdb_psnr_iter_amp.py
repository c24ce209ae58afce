"""RRDBNet x4 PSNR-oriented pre-training (the stage before ESRGAN), iteration based.

* sub-images of DF2K are cut once, by global rank 0, into a folder on the shared file system
* fp16 autocast + GradScaler, gradient accumulation with DDP.no_sync
* validation on full images, every image evaluated exactly once across ranks

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        15_rrdb_psnr_iter_amp.py --df2k /shared/data/DF2K --out /shared/exp/rrdb_psnr_x4
"""
import argparse
import contextlib
import datetime
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from basicsr.archs.rrdbnet_arch import RRDBNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cut_subimages(src_dir, dst_dir, crop, step):
    tmp_dir = dst_dir + ".partial"
    os.makedirs(tmp_dir, exist_ok=True)
    for path in sorted(glob(os.path.join(src_dir, "*.png"))):
        img = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        name = os.path.splitext(os.path.basename(path))[0]
        h, w = img.shape[:2]
        n = 0
        for y in list(range(0, h - crop + 1, step)):
            for x in list(range(0, w - crop + 1, step)):
                n += 1
                cv2.imwrite(os.path.join(tmp_dir, f"{name}_s{n:03d}.png"), img[y:y + crop, x:x + crop],
                            [cv2.IMWRITE_PNG_COMPRESSION, 3])
    os.rename(tmp_dir, dst_dir)


def prepare_data(root, rank):
    hr_sub, lr_sub = os.path.join(root, "HR_sub"), os.path.join(root, "LR_bicubic_X4_sub")
    if rank == 0:
        if not os.path.isdir(hr_sub):
            cut_subimages(os.path.join(root, "HR"), hr_sub, 480, 240)
        if not os.path.isdir(lr_sub):
            cut_subimages(os.path.join(root, "LR_bicubic", "X4"), lr_sub, 120, 60)
    dist.barrier()
    return hr_sub, lr_sub


class SubImagePairs(Dataset):
    def __init__(self, hr_dir, lr_dir, gt_size=128):
        self.hr = sorted(glob(os.path.join(hr_dir, "*.png")))
        self.lr = sorted(glob(os.path.join(lr_dir, "*.png")))
        assert len(self.hr) == len(self.lr)
        self.gt_size = gt_size

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.imread(self.hr[i])[..., ::-1]
        lr = cv2.imread(self.lr[i])[..., ::-1]
        p = self.gt_size // 4
        y, x = random.randint(0, lr.shape[0] - p), random.randint(0, lr.shape[1] - p)
        lr, hr = lr[y:y + p, x:x + p], hr[4 * y:4 * y + self.gt_size, 4 * x:4 * x + self.gt_size]
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        if random.random() < 0.5:
            lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return to_t(lr), to_t(hr)


class IndexedBenchmark(Dataset):
    def __init__(self, root):
        self.hr = sorted(glob(os.path.join(root, "HR", "*.png")))
        self.lr = sorted(glob(os.path.join(root, "LR_bicubic", "X4", "*.png")))

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        lr = cv2.imread(self.lr[i])[..., ::-1]
        hr = cv2.imread(self.hr[i])[..., ::-1][:lr.shape[0] * 4, :lr.shape[1] * 4]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return i, to_t(lr), to_t(hr)


def psnr_y(sr, hr, border=4):
    c = sr.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1)
    a = (((sr.clamp(0, 1) * 255).round() / 255) * c).sum(1)[..., border:-border, border:-border]
    b = (hr * c).sum(1)[..., border:-border, border:-border]
    return 10 * torch.log10(255.0 ** 2 / (a - b).pow(2).mean())


@torch.no_grad()
def validate(net, loader, device, n_images):
    # DistributedSampler pads the last ranks with repeated images: gather (index, psnr) from every
    # rank and keep one value per index.
    net.eval()
    rows = []
    for idx, lr, hr in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            sr = net(lr.to(device))
        rows.append(torch.stack([idx.to(device).float()[0], psnr_y(sr.float(), hr.to(device))]))
    local = torch.stack(rows)
    gathered = torch.empty(dist.get_world_size() * local.shape[0], 2, device=device)
    dist.all_gather_into_tensor(gathered, local)
    per_image = {int(i): p for i, p in gathered.tolist()}
    net.train()
    assert len(per_image) == n_images
    return sum(per_image.values()) / n_images


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--df2k", required=True)
    ap.add_argument("--val", default="/shared/data/benchmark/Set14")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_per_gpu", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--iters", type=int, default=1000000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--init", default="", help="old checkpoint, possibly saved from the DDP wrapper")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a long time cutting sub-images on the first run while the others wait in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    hr_sub, lr_sub = prepare_data(args.df2k, rank)
    train_set = SubImagePairs(hr_sub, lr_sub)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = IndexedBenchmark(args.val)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False), num_workers=2)

    torch.manual_seed(0)
    net = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=4)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("params", sd)
        net.load_state_dict({(k[7:] if k.startswith("module.") else k): v for k, v in sd.items()})
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.iters, eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()

    it = 0
    ckpt_path = os.path.join(args.out, "latest.pth")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["params"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        it = ck["iter"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def batches():
        epoch = it * args.accum // len(loader)
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream, tic = batches(), time.time()
    while it < args.iters:
        for micro in range(args.accum):
            lr, hr = next(stream)
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            last = micro == args.accum - 1
            with (model.no_sync() if not last else contextlib.nullcontext()):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.l1_loss(model(lr).float(), hr) / args.accum
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        it += 1

        if rank == 0 and it % 100 == 0:
            print(f"iter {it} l1 {loss.item() * args.accum:.4f} scale {scaler.get_scale():.0f} "
                  f"{(time.time() - tic) / 100:.3f}s/it", flush=True)
            tic = time.time()
        if it % 5000 == 0 or it == args.iters:
            psnr = validate(net, val_loader, device, len(val_set))
            if rank == 0:
                print(f"[val] iter {it}: PSNR-Y {psnr:.3f}", flush=True)
                ck = {"params": net.state_dict(), "optimizer": optimizer.state_dict(),
                      "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "iter": it}
                torch.save(ck, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
