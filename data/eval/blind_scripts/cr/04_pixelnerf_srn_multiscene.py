"""pixelNeRF-style generalisable NeRF on ShapeNet-SRN (cars / chairs), multi-GPU.

Each sample is one object: a source view is encoded with a ResNet-34 and the
target rays are rendered from features projected into that source view.

    torchrun --nnodes=1 --nproc_per_node=8 train_pixelnerf.py --config configs/srn_cars.yaml
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class SRNDataset(Dataset):
    def __init__(self, root, split, image_size=128):
        self.obj_dirs = sorted(glob.glob(os.path.join(root, f"cars_{split}", "*")))
        self.image_size = image_size
        self._coord_fix = torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0]))

    def __len__(self):
        return len(self.obj_dirs)

    def __getitem__(self, idx):
        d = self.obj_dirs[idx]
        rgb_paths = sorted(glob.glob(os.path.join(d, "rgb", "*.png")))
        pose_paths = sorted(glob.glob(os.path.join(d, "pose", "*.txt")))
        with open(os.path.join(d, "intrinsics.txt")) as f:
            focal = float(f.readline().split()[0])
        imgs, poses = [], []
        for rp, pp in zip(rgb_paths, pose_paths):
            im = np.asarray(Image.open(rp).convert("RGB"), dtype=np.float32) / 255.0
            imgs.append(torch.from_numpy(im).permute(2, 0, 1) * 2.0 - 1.0)
            pose = torch.from_numpy(np.loadtxt(pp, dtype=np.float32).reshape(4, 4))
            poses.append(pose @ self._coord_fix)
        imgs = torch.stack(imgs)
        H = imgs.shape[-2]
        if H != self.image_size:
            scale = self.image_size / H
            imgs = F.interpolate(imgs, size=(self.image_size, self.image_size), mode="area")
            focal = focal * scale
        return {"images": imgs, "poses": torch.stack(poses), "focal": torch.tensor(focal)}


def collate_objects(batch):
    # objects have different numbers of views; keep a fixed subset per object
    n = min(b["images"].shape[0] for b in batch)
    out = {"images": [], "poses": [], "focal": torch.stack([b["focal"] for b in batch])}
    for b in batch:
        sel = torch.randperm(b["images"].shape[0])[:n]
        out["images"].append(b["images"][sel])
        out["poses"].append(b["poses"][sel])
    out["images"] = torch.stack(out["images"])
    out["poses"] = torch.stack(out["poses"])
    return out


class SpatialEncoder(nn.Module):
    def __init__(self, num_layers=4):
        super().__init__()
        net = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu)
        self.pool = net.maxpool
        self.blocks = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4][: num_layers - 1])

    def forward(self, x):
        x = self.stem(x)
        feats = [x]
        x = self.pool(x)
        for blk in self.blocks:
            x = blk(x)
            feats.append(x)
        size = feats[0].shape[-2:]
        feats = [F.interpolate(f, size=size, mode="bilinear", align_corners=True) for f in feats]
        return torch.cat(feats, 1)  # 64 + 64 + 128 + 256 = 512


class ResnetFC(nn.Module):
    def __init__(self, d_in, d_latent=512, d_hidden=512, n_blocks=5, combine_layer=3):
        super().__init__()
        self.lin_in = nn.Linear(d_in, d_hidden)
        self.lin_z = nn.ModuleList([nn.Linear(d_latent, d_hidden) for _ in range(combine_layer)])
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden))
            for _ in range(n_blocks)])
        self.lin_out = nn.Linear(d_hidden, 4)
        self.combine_layer = combine_layer

    def forward(self, x, z):
        h = self.lin_in(x)
        for i, blk in enumerate(self.blocks):
            if i < self.combine_layer:
                h = h + self.lin_z[i](z)
            h = h + blk(h)
        return self.lin_out(F.relu(h))


def posenc(x, n_freqs=6):
    freqs = 2.0 ** torch.arange(n_freqs, device=x.device) * np.pi
    xb = x[..., None] * freqs
    return torch.cat([x, torch.sin(xb).flatten(-2), torch.cos(xb).flatten(-2)], -1)


class PixelNeRF(nn.Module):
    def __init__(self, n_coarse=64, near=0.8, far=1.8):
        super().__init__()
        self.encoder = SpatialEncoder()
        self.mlp = ResnetFC(d_in=3 + 3 * 2 * 6 + 3)
        self.n_coarse, self.near, self.far = n_coarse, near, far

    def forward(self, src_img, src_pose, focal, rays_o, rays_d):
        # src_img (B,3,H,W), src_pose (B,4,4), rays (B,R,3)
        B, _, H, W = src_img.shape
        feat = self.encoder(src_img)
        t = torch.linspace(self.near, self.far, self.n_coarse, device=rays_o.device)
        t = t + torch.rand(B, rays_o.shape[1], self.n_coarse, device=t.device) * (self.far - self.near) / self.n_coarse
        pts = rays_o[:, :, None] + rays_d[:, :, None] * t[..., None]  # B,R,S,3
        w2c = torch.inverse(src_pose)
        pts_cam = (w2c[:, None, None, :3, :3] @ pts[..., None]).squeeze(-1) + w2c[:, None, None, :3, 3]
        dirs_cam = (w2c[:, None, None, :3, :3] @ rays_d[:, :, None, :, None].expand(-1, -1, self.n_coarse, -1, -1)).squeeze(-1)
        uv = -pts_cam[..., :2] / pts_cam[..., 2:].clamp(max=-1e-4)
        uv = uv * focal[:, None, None, None] * torch.tensor([1.0, -1.0], device=uv.device)
        uv = uv / torch.tensor([W / 2.0, H / 2.0], device=uv.device)
        latent = F.grid_sample(feat, uv.view(B, -1, 1, 2), align_corners=True, padding_mode="border")
        latent = latent.squeeze(-1).permute(0, 2, 1).reshape(B, rays_o.shape[1], self.n_coarse, -1)
        out = self.mlp(torch.cat([posenc(pts_cam), dirs_cam], -1), latent)
        rgb, sigma = torch.sigmoid(out[..., :3]), F.relu(out[..., 3])
        delta = torch.cat([t[..., 1:] - t[..., :-1], torch.full_like(t[..., :1], 1e10)], -1)
        alpha = 1.0 - torch.exp(-sigma * delta)
        T = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
        w = alpha * T
        return (w[..., None] * rgb).sum(-2) + (1.0 - w.sum(-1, keepdim=True))


def sample_target_rays(images, poses, focal, n_rays):
    B, V, _, H, W = images.shape
    src = torch.zeros(B, dtype=torch.long, device=images.device)
    tgt = torch.randint(1, V, (B,), device=images.device)
    ar = torch.arange(B, device=images.device)
    pix = torch.randint(0, H * W, (B, n_rays), device=images.device)
    ys, xs = (pix // W).float(), (pix % W).float()
    dirs = torch.stack([(xs - W / 2) / focal[:, None], -(ys - H / 2) / focal[:, None], -torch.ones_like(xs)], -1)
    c2w = poses[ar, tgt]
    rays_d = (c2w[:, None, :3, :3] @ dirs[..., None]).squeeze(-1)
    rays_o = c2w[:, None, :3, 3].expand_as(rays_d)
    gt = images[ar, tgt].flatten(2).gather(2, pix[:, None].expand(-1, 3, -1)).permute(0, 2, 1)
    return images[ar, src], poses[ar, src], rays_o, rays_d, gt * 0.5 + 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"] + rank)

    if rank == 0:
        wandb.init(project=cfg.get("wandb_project", "pixelnerf"), config=cfg, name=cfg["exp_name"])
        os.makedirs(cfg["ckpt_dir"], exist_ok=True)

    train_set = SRNDataset(cfg["data_root"], "train", cfg["image_size"])
    val_set = SRNDataset(cfg["data_root"], "val", cfg["image_size"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"] // world, shuffle=True,
                              num_workers=cfg["num_workers"], collate_fn=collate_objects,
                              pin_memory=True, drop_last=True, persistent_workers=True)

    model = PixelNeRF(n_coarse=cfg["n_coarse"]).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=cfg["lr"])

    step = 0
    for epoch in range(cfg["epochs"]):
        model.train()
        for batch in train_loader:
            images = batch["images"].to(device, non_blocking=True)
            poses = batch["poses"].to(device, non_blocking=True)
            focal = batch["focal"].to(device)
            src_img, src_pose, ro, rd, gt = sample_target_rays(images, poses, focal, cfg["rays_per_object"])
            pred = model(src_img, src_pose, focal, ro, rd)
            loss = F.mse_loss(pred, gt)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1

            if step % cfg["log_every"] == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/psnr": -10 * torch.log10(l).item(),
                               "epoch": epoch}, step=step)

        # validation: a few objects on rank 0 only, model.module avoids DDP hooks
        if rank == 0:
            model.eval()
            psnrs = []
            with torch.no_grad():
                for i in range(0, len(val_set), max(1, len(val_set) // 16)):
                    obj = collate_objects([val_set[i]])
                    images = obj["images"].to(device)
                    poses = obj["poses"].to(device)
                    focal = obj["focal"].to(device)
                    src_img, src_pose, ro, rd, gt = sample_target_rays(images, poses, focal, 4096)
                    pred = model.module(src_img, src_pose, focal, ro, rd)
                    psnrs.append(-10 * torch.log10(F.mse_loss(pred, gt)).item())
            wandb.log({"val/psnr": float(np.mean(psnrs))}, step=step)
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "epoch": epoch, "step": step},
                       os.path.join(cfg["ckpt_dir"], "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
