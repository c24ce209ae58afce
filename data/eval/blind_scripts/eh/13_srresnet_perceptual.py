"""MSRResNet x4 fine-tuning with L1 + VGG perceptual loss (no adversarial term) for the
"natural zoom" camera preset.  Uses a CUDA prefetcher since the crops are small and the
loader was the bottleneck on the A100 boxes.

    torchrun --nproc_per_node=8 13_srresnet_perceptual.py --opt options/msrresnet_percep_x4.yml
"""
import argparse
import logging
import os
import os.path as osp
import random
import time
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("percep")


class CUDAPrefetcher:
    """Overlaps host->device copies of the next batch with compute of the current one."""

    def __init__(self, loader, device=torch.device("cuda:0")):
        self.ori_loader = loader
        self.loader = iter(loader)
        self.device = device
        self.stream = torch.cuda.Stream()
        self.preload()

    def preload(self):
        try:
            self.batch = next(self.loader)
        except StopIteration:
            self.batch = None
            return
        with torch.cuda.stream(self.stream):
            for k, v in self.batch.items():
                if torch.is_tensor(v):
                    self.batch[k] = v.to(device=self.device, non_blocking=True)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        batch = self.batch
        self.preload()
        return batch

    def reset(self):
        self.loader = iter(self.ori_loader)
        self.preload()


class ResidualBlockNoBN(nn.Module):
    def __init__(self, nf=64):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf, nf, 3, 1, 1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x), inplace=True))


class MSRResNet(nn.Module):
    def __init__(self, nf=64, nb=16, upscale=4):
        super().__init__()
        self.upscale = upscale
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualBlockNoBN(nf) for _ in range(nb)])
        self.upconv1 = nn.Conv2d(nf, nf * 4, 3, 1, 1)
        self.upconv2 = nn.Conv2d(nf, nf * 4, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.ps = nn.PixelShuffle(2)

    def forward(self, x):
        feat = F.leaky_relu(self.conv_first(x), 0.1)
        out = self.body(feat)
        out = F.leaky_relu(self.ps(self.upconv1(out)), 0.1)
        out = F.leaky_relu(self.ps(self.upconv2(out)), 0.1)
        out = self.conv_last(F.leaky_relu(self.conv_hr(out), 0.1))
        base = F.interpolate(x, scale_factor=self.upscale, mode="bilinear", align_corners=False)
        return out + base


class VGGPerceptualLoss(nn.Module):
    LAYERS = {"conv1_2": 2, "conv2_2": 7, "conv3_4": 16, "conv4_4": 25, "conv5_4": 34}

    def __init__(self, weights_path, layer_weights):
        super().__init__()
        vgg = torchvision.models.vgg19()
        vgg.load_state_dict(torch.load(weights_path, map_location="cpu"))
        last = max(self.LAYERS[k] for k in layer_weights)
        self.vgg = vgg.features[: last + 1].eval()
        for p in self.vgg.parameters():
            p.requires_grad_(False)
        self.layer_weights = layer_weights
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def _features(self, x):
        wanted = {self.LAYERS[k]: k for k in self.layer_weights}
        feats, h = {}, (x - self.mean) / self.std
        for idx, layer in enumerate(self.vgg):
            h = layer(h)
            if idx in wanted:
                feats[wanted[idx]] = h
        return feats

    def forward(self, sr, gt):
        fs = self._features(sr)
        with torch.no_grad():
            fg = self._features(gt)
        return sum(w * F.l1_loss(fs[k], fg[k]) for k, w in self.layer_weights.items())


class PairedCrops(Dataset):
    def __init__(self, gt_dir, lq_dir, scale, gt_size=None):
        self.gt = sorted(glob(osp.join(gt_dir, "*.png")))
        self.lq = [osp.join(lq_dir, osp.basename(p)) for p in self.gt]
        self.scale, self.gt_size = scale, gt_size

    def __len__(self):
        return len(self.gt)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt[i])[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(self.lq[i])[:, :, ::-1].astype(np.float32) / 255.0
        if self.gt_size:
            s, ls = self.scale, self.gt_size // self.scale
            y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
            lq, gt = lq[y:y + ls, x:x + ls], gt[y * s:(y + ls) * s, x * s:(x + ls) * s]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
            if random.random() < 0.5:
                lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return {"lq": t(lq), "gt": t(gt), "name": osp.basename(self.gt[i])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt", required=True)
    opt = yaml.safe_load(open(parser.parse_args().opt))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(opt["seed"])
    random.seed(opt["seed"] + rank)

    scale = opt["scale"]
    tr = opt["datasets"]["train"]
    train_set = PairedCrops(tr["gt"], tr["lq"], scale, tr["gt_size"])
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=tr["batch_size_per_gpu"], sampler=sampler,
                              num_workers=tr["num_workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    va = opt["datasets"]["val"]
    val_set = PairedCrops(va["gt"], va["lq"], scale)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=1)

    net = MSRResNet(upscale=scale).to(device)
    net.load_state_dict(torch.load(opt["pretrain"], map_location="cpu")["params"])
    model = DDP(net, device_ids=[local_rank])
    cri_pix = nn.L1Loss()
    cri_percep = VGGPerceptualLoss(opt["vgg19_path"], opt["percep_layers"]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=opt["lr"], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=opt["total_iter"], eta_min=1e-7)

    exp_dir = osp.join("experiments", opt["name"])
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)

    prefetcher = CUDAPrefetcher(train_loader)
    it, epoch = 0, 0
    tic = time.time()
    while it < opt["total_iter"]:
        sampler.set_epoch(epoch)
        prefetcher.reset()
        batch = prefetcher.next()
        while batch is not None:
            lq, gt = batch["lq"], batch["gt"]
            sr = model(lq)
            l_pix = opt["w_pix"] * cri_pix(sr, gt)
            l_percep = opt["w_percep"] * cri_percep(sr, gt)
            loss = l_pix + l_percep
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 100 == 0:
                logger.info("iter %d l_pix %.4f l_percep %.4f (%.3fs/it)", it, l_pix.item(), l_percep.item(),
                            (time.time() - tic) / 100)
                tic = time.time()
            if it % opt["val_freq"] == 0:
                net.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vb in val_loader:
                        out = net(vb["lq"].to(device)).clamp(0, 1)
                        g = vb["gt"].to(device)
                        out = torch.round(out * 255) / 255
                        acc[0] += 10 * torch.log10(1 / F.mse_loss(out[..., scale:-scale, scale:-scale].double(),
                                                                  g[..., scale:-scale, scale:-scale].double()))
                        acc[1] += 1
                net.train()
                dist.all_reduce(acc)
                logger.info("[val] iter %d PSNR-RGB %.3f", it, (acc[0] / acc[1]).item())
                if rank == 0:
                    torch.save({"params": net.state_dict(), "iter": it}, osp.join(exp_dir, f"net_g_{it}.pth"))
            if it >= opt["total_iter"]:
                break
            batch = prefetcher.next()
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
