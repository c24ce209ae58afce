"""
E2E-VarNet (12 cascades, 18-chan NormUNets, sensitivity estimation) on fastMRI multicoil knee,
sharded with FSDP so that the wide variant (chans=32, pools=5) fits in memory at full resolution.

    torchrun --nnodes 1 --nproc_per_node 8 06_varnet_fsdp_knee.py --data /data/fastmri/knee_mc --chans 32
"""
import argparse
import functools
import os
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ------------------------------------------------------------------ complex helpers (last dim = 2)
def fft2c(x):
    x = torch.view_as_complex(x.contiguous())
    x = torch.fft.fftshift(torch.fft.fftn(torch.fft.ifftshift(x, dim=(-2, -1)), dim=(-2, -1), norm="ortho"), dim=(-2, -1))
    return torch.view_as_real(x)


def ifft2c(x):
    x = torch.view_as_complex(x.contiguous())
    x = torch.fft.fftshift(torch.fft.ifftn(torch.fft.ifftshift(x, dim=(-2, -1)), dim=(-2, -1), norm="ortho"), dim=(-2, -1))
    return torch.view_as_real(x)


def cmul(a, b):
    re = a[..., 0] * b[..., 0] - a[..., 1] * b[..., 1]
    im = a[..., 0] * b[..., 1] + a[..., 1] * b[..., 0]
    return torch.stack([re, im], -1)


def cconj(a):
    return torch.stack([a[..., 0], -a[..., 1]], -1)


def rss_complex(x, dim=1):
    return torch.sqrt((x ** 2).sum(-1).sum(dim))


# ------------------------------------------------------------------ model
class NormUnet(nn.Module):
    def __init__(self, chans, pools, in_ch=2, out_ch=2):
        super().__init__()
        self.down = nn.ModuleList()
        ch = chans
        self.down.append(self._block(in_ch, ch))
        for _ in range(pools - 1):
            self.down.append(self._block(ch, ch * 2))
            ch *= 2
        self.mid = self._block(ch, ch * 2)
        self.up_t = nn.ModuleList()
        self.up_c = nn.ModuleList()
        for _ in range(pools):
            self.up_t.append(nn.ConvTranspose2d(ch * 2, ch, 2, 2, bias=False))
            self.up_c.append(self._block(ch * 2, ch))
            ch //= 2
        self.out = nn.Conv2d(chans, out_ch, 1)
        self.pools = pools

    @staticmethod
    def _block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.InstanceNorm2d(o), nn.LeakyReLU(0.2, True),
                             nn.Conv2d(o, o, 3, padding=1, bias=False), nn.InstanceNorm2d(o), nn.LeakyReLU(0.2, True))

    def forward(self, x):  # x: (B, C, H, W, 2)
        b, c, h, w, _ = x.shape
        x = x.permute(0, 4, 1, 2, 3).reshape(b, 2 * c, h, w)
        mean = x.mean((2, 3), keepdim=True)
        std = x.std((2, 3), keepdim=True) + 1e-6
        x = (x - mean) / std
        m = 2 ** self.pools
        ph, pw = (-h) % m, (-w) % m
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        stack = []
        for d in self.down:
            x = d(x)
            stack.append(x)
            x = F.avg_pool2d(x, 2)
        x = self.mid(x)
        for t, u in zip(self.up_t, self.up_c):
            x = u(torch.cat([t(x), stack.pop()], 1))
        x = self.out(x)[..., ph // 2: ph // 2 + h, pw // 2: pw // 2 + w]
        x = x * std + mean
        return x.view(b, 2, c, h, w).permute(0, 2, 3, 4, 1).contiguous()


class SensModel(nn.Module):
    def __init__(self, chans=8, pools=4):
        super().__init__()
        self.unet = NormUnet(chans, pools)

    def forward(self, masked_kspace, num_low):
        b, c, h, w, _ = masked_kspace.shape
        pad = (w - num_low + 1) // 2
        acs = torch.zeros_like(masked_kspace)
        acs[:, :, :, pad:pad + num_low] = masked_kspace[:, :, :, pad:pad + num_low]
        imgs = ifft2c(acs).reshape(b * c, 1, h, w, 2)
        sens = self.unet(imgs).reshape(b, c, h, w, 2)
        return sens / rss_complex(sens, 1)[:, None, ..., None]


class VarNetBlock(nn.Module):
    def __init__(self, chans, pools):
        super().__init__()
        self.model = NormUnet(chans, pools)
        self.dc_weight = nn.Parameter(torch.ones(1))

    def forward(self, k, ref_k, mask, sens):
        img = cmul(ifft2c(k), cconj(sens)).sum(1, keepdim=True)
        refined = fft2c(cmul(self.model(img), sens))
        dc = torch.where(mask, k - ref_k, torch.zeros_like(k)) * self.dc_weight
        return k - dc - refined


class VarNet(nn.Module):
    def __init__(self, cascades=12, chans=18, pools=4, sens_chans=8):
        super().__init__()
        self.sens_net = SensModel(sens_chans)
        self.cascades = nn.ModuleList([VarNetBlock(chans, pools) for _ in range(cascades)])

    def forward(self, masked_kspace, mask, num_low):
        sens = self.sens_net(masked_kspace, num_low)
        k = masked_kspace.clone()
        for c in self.cascades:
            k = c(k, masked_kspace, mask, sens)
        return rss_complex(ifft2c(k), 1)


# ------------------------------------------------------------------ data
class MultiCoilKnee(Dataset):
    def __init__(self, folder, accel=4, cf=0.08, val=False):
        self.items = []
        for f in sorted(Path(folder).glob("*.h5")):
            with h5py.File(f, "r") as hf:
                self.items += [(f, s) for s in range(hf["kspace"].shape[0])]
        self.accel, self.cf, self.val = accel, cf, val

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, s = self.items[i]
        with h5py.File(f, "r") as hf:
            k = hf["kspace"][s]
            tgt = hf["reconstruction_rss"][s]
            mx = float(hf.attrs["max"])
        k = torch.view_as_real(torch.from_numpy(k))
        w = k.shape[-2]
        rng = np.random.default_rng(i if self.val else None)
        num_low = int(round(w * self.cf))
        prob = (w / self.accel - num_low) / (w - num_low)
        m = rng.uniform(size=w) < prob
        pad = (w - num_low + 1) // 2
        m[pad:pad + num_low] = True
        mask = torch.from_numpy(m).view(1, 1, w, 1).expand(k.shape[0], k.shape[1], w, 2).clone()
        return k * mask, mask, num_low, torch.from_numpy(tgt), mx


def ssim_loss(x, y, data_range, win=7):
    w = torch.ones(1, 1, win, win, device=x.device) / win ** 2
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    ux, uy = F.conv2d(x, w), F.conv2d(y, w)
    vx, vy = F.conv2d(x * x, w) - ux ** 2, F.conv2d(y * y, w) - uy ** 2
    vxy = F.conv2d(x * y, w) - ux * uy
    s = (2 * ux * uy + c1) * (2 * vxy + c2) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
    return 1 - s.mean()


def center_crop(x, shape):
    h, w = x.shape[-2:]
    t, l = (h - shape[0]) // 2, (w - shape[1]) // 2
    return x[..., t:t + shape[0], l:l + shape[1]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/varnet_fsdp")
    ap.add_argument("--chans", type=int, default=18)
    ap.add_argument("--cascades", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    model = VarNet(cascades=args.cascades, chans=args.chans)
    model = FSDP(model,
                 auto_wrap_policy=ModuleWrapPolicy({VarNetBlock, SensModel}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32),
                 device_id=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 40, 0.1)

    train_ds = MultiCoilKnee(os.path.join(args.data, "multicoil_train"))
    val_ds = MultiCoilKnee(os.path.join(args.data, "multicoil_val"), val=True)
    tsamp = DistributedSampler(train_ds, shuffle=True)
    vsamp = DistributedSampler(val_ds, shuffle=False)
    tl = DataLoader(train_ds, batch_size=1, sampler=tsamp, num_workers=6, pin_memory=True)
    vl = DataLoader(val_ds, batch_size=1, sampler=vsamp, num_workers=6)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    for epoch in range(args.epochs):
        tsamp.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (k, mask, num_low, tgt, mx) in enumerate(tl):
            k, mask, tgt = k.to(dev), mask.to(dev).bool(), tgt.to(dev)
            out = center_crop(model(k, mask, int(num_low[0])), tgt.shape[-2:])
            loss = ssim_loss(out[:, None], tgt[:, None], mx.to(dev).float().view(-1, 1, 1, 1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}:{it}/{len(tl)}] ssim loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        tot = torch.zeros(2, device=dev)
        with torch.no_grad():
            for k, mask, num_low, tgt, mx in vl:
                k, mask, tgt = k.to(dev), mask.to(dev).bool(), tgt.to(dev)
                out = center_crop(model(k, mask, int(num_low[0])), tgt.shape[-2:])
                tot[0] += 1 - ssim_loss(out[:, None], tgt[:, None], mx.to(dev).float().view(-1, 1, 1, 1))
                tot[1] += 1
        dist.all_reduce(tot)
        val_ssim = (tot[0] / tot[1]).item()

        if rank == 0:
            print(f"epoch {epoch} val ssim {val_ssim:.4f} time {time.time() - t0:.0f}s", flush=True)
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                state = model.state_dict()
            torch.save({"epoch": epoch, "model": state, "val_ssim": val_ssim},
                       os.path.join(args.out, f"varnet_e{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
