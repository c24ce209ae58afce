"""ESRGAN x4 GAN training for the camera "detail" preset.

RRDBNet G (from our PSNR stage, possibly saved with a DDP "module." prefix), VGG-style D with
SyncBatchNorm, RaGAN + VGG19 conv5_4 perceptual + L1.

    torchrun --nproc_per_node=8 15_esrgan_vgg_disc.py --config configs/esrgan_detail_x4.yaml
"""
import argparse
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class RDB(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)

    def forward(self, x):
        a = lambda t: F.leaky_relu(t, 0.2)
        x1 = a(self.conv1(x))
        x2 = a(self.conv2(torch.cat((x, x1), 1)))
        x3 = a(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = a(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        return self.conv5(torch.cat((x, x1, x2, x3, x4), 1)) * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = RDB(nf), RDB(nf), RDB(nf)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        f = self.conv_first(x)
        f = f + self.conv_body(self.body(f))
        f = F.leaky_relu(self.conv_up1(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        f = F.leaky_relu(self.conv_up2(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(f), 0.2))


class VGGStyleDiscriminator(nn.Module):
    def __init__(self, nf=64):
        super().__init__()
        def blk(cin, cout, k, s):
            return [nn.Conv2d(cin, cout, k, s, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]
        layers = [nn.Conv2d(3, nf, 3, 1, 1), nn.LeakyReLU(0.2, True)] + blk(nf, nf, 4, 2)
        c = nf
        for mult in (2, 4, 8, 8):
            layers += blk(c, nf * mult, 3, 1) + blk(nf * mult, nf * mult, 4, 2)
            c = nf * mult
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(c * 4 * 4, 100), nn.LeakyReLU(0.2, True), nn.Linear(100, 1))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class PerceptualLoss(nn.Module):
    def __init__(self, vgg_path):
        super().__init__()
        vgg = torchvision.models.vgg19()
        vgg.load_state_dict(torch.load(vgg_path, map_location="cpu"))
        self.net = vgg.features[:35].eval().requires_grad_(False)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        with torch.no_grad():
            fg = self.net((gt - self.mean) / self.std)
        return F.l1_loss(self.net((x - self.mean) / self.std), fg)


class PairedSR(Dataset):
    def __init__(self, gt_dir, lq_dir, gt_size=None, scale=4):
        self.gt = sorted(glob(os.path.join(gt_dir, "*.png")))
        self.lq = [os.path.join(lq_dir, os.path.basename(p)) for p in self.gt]
        self.gt_size, self.scale = gt_size, scale

    def __len__(self):
        return len(self.gt)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt[i])[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(self.lq[i])[:, :, ::-1].astype(np.float32) / 255.0
        if self.gt_size:
            ls, s = self.gt_size // self.scale, self.scale
            y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
            lq, gt = lq[y:y + ls, x:x + ls], gt[y * s:(y + ls) * s, x * s:(x + ls) * s]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return t(lq), t(gt), i


def load_generator_weights(net, path):
    state = torch.load(path, map_location="cpu")
    state = state.get("params_ema", state.get("params", state))
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    net.load_state_dict(state, strict=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"] + rank)

    exp = cfg["exp_dir"]
    vis_dir = os.path.join(exp, "visuals")
    if rank == 0:
        os.makedirs(os.path.join(exp, "models"), exist_ok=True)
        os.makedirs(vis_dir, exist_ok=True)
    dist.barrier()
    tb = SummaryWriter(os.path.join(exp, "tb")) if rank == 0 else None

    train_set = PairedSR(cfg["train_gt"], cfg["train_lq"], cfg["gt_size"])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    val_set = PairedSR(cfg["val_gt"], cfg["val_lq"])

    net_g = RRDBNet().to(device)
    load_generator_weights(net_g, cfg["pretrain_g"])
    net_d = nn.SyncBatchNorm.convert_sync_batchnorm(VGGStyleDiscriminator()).to(device)
    net_g = DDP(net_g, device_ids=[local_rank])
    # SyncBN keeps the running stats identical on all ranks, no need to re-broadcast them every forward
    net_d = DDP(net_d, device_ids=[local_rank], broadcast_buffers=False)

    cri_percep = PerceptualLoss(cfg["vgg19_path"]).to(device)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-4, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-4, betas=(0.9, 0.99))
    sch_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, [50000, 100000, 200000, 300000], 0.5)
    sch_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, [50000, 100000, 200000, 300000], 0.5)

    it, epoch = 0, 0
    if cfg.get("resume"):
        st = torch.load(cfg["resume"], map_location="cpu")
        net_g.module.load_state_dict(st["net_g"])
        net_d.module.load_state_dict(st["net_d"])
        opt_g.load_state_dict(st["opt_g"])
        opt_d.load_state_dict(st["opt_d"])
        sch_g.load_state_dict(st["sch_g"])
        sch_d.load_state_dict(st["sch_d"])
        it = st["iter"]
        epoch = it // len(loader)

    while it < cfg["total_iter"]:
        sampler.set_epoch(epoch)
        for lq, gt, _ in loader:
            it += 1
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)

            # ---- G
            net_d.requires_grad_(False)
            opt_g.zero_grad(set_to_none=True)
            output = net_g(lq)
            l_pix = 1e-2 * F.l1_loss(output, gt)
            l_percep = cri_percep(output, gt)
            real_d_pred = net_d(gt).detach()
            fake_g_pred = net_d(output)
            l_g_gan = 5e-3 * 0.5 * (
                F.binary_cross_entropy_with_logits(real_d_pred - fake_g_pred.mean(), torch.zeros_like(real_d_pred))
                + F.binary_cross_entropy_with_logits(fake_g_pred - real_d_pred.mean(), torch.ones_like(fake_g_pred)))
            (l_pix + l_percep + l_g_gan).backward()
            opt_g.step()

            # ---- D: real and fake in two separate forward/backward passes
            net_d.requires_grad_(True)
            opt_d.zero_grad(set_to_none=True)
            fake_d_pred = net_d(output.detach()).detach()
            real_d_pred = net_d(gt)
            l_d_real = 0.5 * F.binary_cross_entropy_with_logits(real_d_pred - fake_d_pred.mean(),
                                                                torch.ones_like(real_d_pred))
            l_d_real.backward()
            fake_d_pred = net_d(output.detach())
            l_d_fake = 0.5 * F.binary_cross_entropy_with_logits(fake_d_pred - real_d_pred.detach().mean(),
                                                                torch.zeros_like(fake_d_pred))
            l_d_fake.backward()
            opt_d.step()
            sch_g.step()
            sch_d.step()

            if tb is not None and it % 100 == 0:
                for k, v in dict(l_pix=l_pix, l_percep=l_percep, l_g_gan=l_g_gan,
                                 l_d_real=l_d_real, l_d_fake=l_d_fake).items():
                    tb.add_scalar(f"loss/{k}", v.item(), it)

            if it % cfg["val_freq"] == 0:
                g = net_g.module.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for j in range(rank, len(val_set), world):
                        vlq, vgt, idx = val_set[j]
                        sr = g(vlq[None].to(device)).clamp(0, 1)
                        sr_u8 = (sr[0].permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
                        cv2.imwrite(os.path.join(vis_dir, f"{idx:04d}_{it}.png"), sr_u8[:, :, ::-1])
                        sr = torch.from_numpy(sr_u8.transpose(2, 0, 1).copy()).float().div(255).to(device)
                        acc[0] += 10 * torch.log10(1 / F.mse_loss(sr[:, 4:-4, 4:-4].double(),
                                                                 vgt[:, 4:-4, 4:-4].to(device).double()))
                        acc[1] += 1
                g.train()
                dist.all_reduce(acc)
                if tb is not None:
                    tb.add_scalar("val/psnr", (acc[0] / acc[1]).item(), it)

            if it % cfg["save_freq"] == 0 and rank == 0:
                torch.save({"net_g": net_g.module.state_dict(), "net_d": net_d.module.state_dict(),
                            "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                            "sch_g": sch_g.state_dict(), "sch_d": sch_d.state_dict(), "iter": it},
                           os.path.join(exp, "models", f"state_{it}.pth"))
            if it >= cfg["total_iter"]:
                break
        epoch += 1

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
