"""Stage 1 of a triplane diffusion pipeline: fit one triplane per object with a
shared MLP decoder (objects rendered from Objaverse, 64 views each).

The renders of object k are only loaded by rank k % world; each GPU optimises
one of its own objects per step, so most triplanes receive no gradient in a step.

    torchrun --nproc_per_node=8 17_triplane_fitting_shared_decoder.py --list data/objaverse_lvis_1k.txt \
        --render_root /data/objaverse_renders --out runs/triplanes_1k
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP


def load_object(root, uid, n_views):
    with open(os.path.join(root, uid, "transforms.json")) as f:
        meta = json.load(f)
    frames = meta["frames"][:n_views]
    imgs = []
    for fr in frames:
        im = np.asarray(Image.open(os.path.join(root, uid, fr["file_path"])).convert("RGBA"), dtype=np.float32) / 255.0
        imgs.append(im[..., :3] * im[..., 3:] + (1 - im[..., 3:]))
    c2w = np.stack([fr["transform_matrix"] for fr in frames]).astype(np.float32)
    H = imgs[0].shape[0]
    focal = 0.5 * H / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy((np.stack(imgs) * 255).astype(np.uint8)), torch.from_numpy(c2w), focal


class TriplaneBank(nn.Module):
    def __init__(self, n_objects, channels=32, res=64, hidden=128):
        super().__init__()
        self.planes = nn.ParameterList([nn.Parameter(torch.randn(3, channels, res, res) * 0.1) for _ in range(n_objects)])
        self.decoder = nn.Sequential(nn.Linear(channels, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                     nn.Linear(hidden, 4))

    def query(self, obj, pts):
        p = self.planes[obj]
        coords = torch.stack([pts[:, [0, 1]], pts[:, [0, 2]], pts[:, [1, 2]]])[:, :, None]  # [3,N,1,2]
        f = F.grid_sample(p, coords, align_corners=False, padding_mode="zeros").squeeze(-1)  # [3,C,N]
        out = self.decoder(f.sum(0).T)
        return torch.sigmoid(out[:, :3]) * 1.002 - 0.001, F.softplus(out[:, 3] - 1)

    def forward(self, obj, rays_o, rays_d, n_samples=96, near=0.5, far=2.5, perturb=True):
        t = torch.linspace(near, far, n_samples, device=rays_o.device).expand(rays_o.shape[0], -1)
        if perturb:
            t = t + torch.rand_like(t) * (far - near) / n_samples
        pts = rays_o[:, None] + rays_d[:, None] * t[..., None]
        rgb, sigma = self.query(obj, pts.reshape(-1, 3))
        rgb, sigma = rgb.view(*t.shape, 3), sigma.view(t.shape)
        delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True)), self.planes[obj].pow(2).mean()


def sample_rays(imgs, c2w, focal, n, device):
    V, H, W = imgs.shape[:3]
    v = torch.randint(0, V, (n,))
    x, y = torch.randint(0, W, (n,)), torch.randint(0, H, (n,))
    d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones(n)], -1)
    d = (c2w[v, :3, :3] @ d[..., None]).squeeze(-1)
    return c2w[v, :3, 3].to(device), F.normalize(d, dim=-1).to(device), (imgs[v, y, x].float() / 255).to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", required=True)
    ap.add_argument("--render_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_views", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200000)
    ap.add_argument("--rays", type=int, default=32768, help="rays per step over all GPUs (one object per GPU)")
    ap.add_argument("--lr_planes", type=float, default=1e-2)
    ap.add_argument("--lr_decoder", type=float, default=1e-3)
    ap.add_argument("--l2_planes", type=float, default=1e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    rng = random.Random(1000 + rank)
    torch.manual_seed(1000 + rank)

    with open(args.list) as f:
        uids = [l.strip() for l in f if l.strip()]
    mine = list(range(rank, len(uids), world))
    objects = {k: load_object(args.render_root, uids[k], args.n_views) for k in mine}
    if rank == 0:
        print(f"{len(uids)} objects, {args.n_views} views each, {world} GPUs", flush=True)

    model = TriplaneBank(len(uids)).to(dev)
    # only one object's triplane is touched per GPU and step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optim = torch.optim.Adam([{"params": model.module.planes.parameters(), "lr": args.lr_planes},
                              {"params": model.module.decoder.parameters(), "lr": args.lr_decoder}])
    os.makedirs(args.out, exist_ok=True)

    for it in range(1, args.iters + 1):
        obj = rng.choice(mine)
        imgs, c2w, focal = objects[obj]
        o, d, gt = sample_rays(imgs, c2w, focal, args.rays // world, dev)
        pred, plane_l2 = model(obj, o, d)
        mse = F.mse_loss(pred, gt)
        loss = mse + args.l2_planes * plane_l2
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()

        if it % 500 == 0:
            m = mse.detach().clone()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"it {it} psnr {-10 * math.log10(m.item()):.2f}", flush=True)

        if it % 20000 == 0 or it == args.iters:
            # per-object PSNR on 4096 random pixels, objects divided between ranks
            net = model.module
            res = {}
            with torch.no_grad():
                for k in mine:
                    o, d, gt = sample_rays(*objects[k], 4096, dev)
                    res[uids[k]] = (-10 * torch.log10(F.mse_loss(net(k, o, d, perturb=False)[0], gt))).item()
            parts = [None] * world
            dist.all_gather_object(parts, res)
            if rank == 0:
                merged = {k: v for p in parts for k, v in p.items()}
                with open(os.path.join(args.out, f"psnr_{it:07d}.json"), "w") as f:
                    json.dump(merged, f)
                print(f"[eval {it}] mean PSNR over {len(merged)} objects: {np.mean(list(merged.values())):.2f}")
                torch.save({"it": it, "uids": uids, "decoder": net.decoder.state_dict(),
                            "planes": torch.stack([p.detach().cpu() for p in net.planes])},
                           os.path.join(args.out, "triplanes.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
