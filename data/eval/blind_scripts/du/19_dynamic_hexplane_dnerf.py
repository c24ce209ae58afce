"""Dynamic scenes with a HexPlane / K-Planes style space-time factorisation (D-NeRF data).

Six feature planes (xy, xz, yz, xt, yt, zt) at two scales, multiplied and decoded
by a small MLP. DDP over random ray batches; SSIM / PSNR on the test split.

    torchrun --nproc_per_node=4 19_dynamic_hexplane_dnerf.py --data /data/dnerf/jumpingjacks --out runs/jj
"""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

PAIRS = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


class HexPlane(nn.Module):
    def __init__(self, res_xyz=(64, 128), res_t=25, dim=16, bound=1.3):
        super().__init__()
        self.bound = bound
        self.scales = nn.ModuleList()
        for r in res_xyz:
            planes = nn.ParameterList()
            for a, b in PAIRS:
                ra = r
                rb = res_t if b == 3 else r
                init = torch.ones(1, dim, rb, ra) if b == 3 else torch.empty(1, dim, rb, ra).uniform_(0.1, 0.5)
                planes.append(nn.Parameter(init))
            self.scales.append(planes)
        self.decoder = nn.Sequential(nn.Linear(dim * len(res_xyz) + 3 * 9, 128), nn.ReLU(True),
                                     nn.Linear(128, 128), nn.ReLU(True), nn.Linear(128, 4))

    def encode(self, xyzt):
        feats = []
        for planes in self.scales:
            f = 1.0
            for p, (a, b) in zip(planes, PAIRS):
                g = xyzt[:, [a, b]].view(1, -1, 1, 2)
                f = f * F.grid_sample(p, g, align_corners=True).view(p.shape[1], -1).T
            feats.append(f)
        return torch.cat(feats, -1)

    def forward(self, o, d, t, near=2.0, far=6.0, n=128, perturb=True):
        z = torch.linspace(near, far, n, device=o.device).expand(o.shape[0], -1)
        if perturb:
            z = z + torch.rand_like(z) * (far - near) / n
        pts = o[:, None] + d[:, None] * z[..., None]
        x = (pts / self.bound).clamp(-1, 1).reshape(-1, 3)
        tt = (t[:, None, None].expand(-1, n, 1).reshape(-1, 1) * 2 - 1)
        feat = self.encode(torch.cat([x, tt], -1))
        dn = F.normalize(d, dim=-1)[:, None].expand(-1, n, -1).reshape(-1, 3)
        fr = 2.0 ** torch.arange(4, device=o.device)
        denc = torch.cat([dn, torch.sin((dn[..., None] * fr).flatten(-2)), torch.cos((dn[..., None] * fr).flatten(-2))], -1)
        out = self.decoder(torch.cat([feat, denc], -1)).view(o.shape[0], n, 4)
        sigma, rgb = F.softplus(out[..., 0] - 1), torch.sigmoid(out[..., 1:])
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True))

    def time_smoothness(self):
        loss = 0.0
        for planes in self.scales:
            for p, (a, b) in zip(planes, PAIRS):
                if b == 3:
                    loss = loss + (p[:, :, 2:] - 2 * p[:, :, 1:-1] + p[:, :, :-2]).pow(2).mean()
        return loss


def load_dnerf(root, split, half_res=True):
    with open(os.path.join(root, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs, poses, times = [], [], []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        if half_res:
            im = im.reshape(im.shape[0] // 2, 2, im.shape[1] // 2, 2, 4).mean((1, 3))
        imgs.append(im[..., :3] * im[..., 3:] + 1 - im[..., 3:])
        poses.append(np.array(fr["transform_matrix"], dtype=np.float32))
        times.append(float(fr["time"]))
    imgs = np.stack(imgs)
    focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(imgs), torch.from_numpy(np.stack(poses)), torch.tensor(times), focal


def rays(c2w, focal, H, W, x, y):
    d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones_like(x)], -1)
    return c2w[..., :3, 3].expand_as(d), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=30000)
    ap.add_argument("--rays", type=int, default=4096, help="global")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--w_time", type=float, default=1e-3)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(100 + rank)

    imgs, poses, times, focal = load_dnerf(args.data, "train")
    test_imgs, test_poses, test_times, _ = load_dnerf(args.data, "test")
    imgs, poses, times = imgs.to(dev), poses.to(dev), times.to(dev)
    N, H, W = imgs.shape[:3]

    model = DDP(HexPlane().to(dev), device_ids=[local_rank])
    optim = torch.optim.Adam([{"params": model.module.scales.parameters(), "lr": args.lr},
                              {"params": model.module.decoder.parameters(), "lr": args.lr * 0.1}])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, args.iters)
    writer = SummaryWriter(args.out) if rank == 0 else None
    m = args.rays // world

    for it in range(1, args.iters + 1):
        v = torch.randint(0, N, (m,), device=dev)
        x, y = torch.randint(0, W, (m,), device=dev), torch.randint(0, H, (m,), device=dev)
        o, d = rays(poses[v], focal, H, W, x.float(), y.float())
        pred = model(o, d, times[v])
        mse = F.mse_loss(pred, imgs[v, y, x])
        loss = mse + args.w_time * model.module.time_smoothness()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if it % 250 == 0:
            l = mse.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/psnr", -10 * math.log10(l.item()), it)

        if it % args.eval_every == 0:
            net = model.module.eval()
            psnr_sum, ssim_sum, count = 0.0, 0.0, 0
            ys, xs = torch.meshgrid(torch.arange(H, device=dev).float(), torch.arange(W, device=dev).float(), indexing="ij")
            with torch.no_grad():
                for i in range(rank, test_imgs.shape[0], world):
                    o, d = rays(test_poses[i].to(dev), focal, H, W, xs.reshape(-1), ys.reshape(-1))
                    t = test_times[i].to(dev).expand(o.shape[0])
                    img = torch.cat([net(o[s:s + 4096], d[s:s + 4096], t[s:s + 4096], perturb=False)
                                     for s in range(0, o.shape[0], 4096)]).view(H, W, 3).clamp(0, 1)
                    gt = test_imgs[i].to(dev)
                    psnr_sum += (-10 * torch.log10(F.mse_loss(img, gt))).item()
                    ssim_sum += ssim(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0).item()
                    count += 1
                    if i == 0:
                        imageio.imwrite(os.path.join(args.out, f"test0_{it:06d}.png"), (img.cpu().numpy() * 255).astype(np.uint8))
            stats = torch.tensor([psnr_sum, ssim_sum, count], dtype=torch.float64)
            dist.all_reduce(stats)
            if rank == 0:
                writer.add_scalar("test/psnr", (stats[0] / stats[2]).item(), it)
                writer.add_scalar("test/ssim", (stats[1] / stats[2]).item(), it)
                torch.save({"it": it, "model": net.state_dict()}, os.path.join(args.out, "hexplane.pt"))
            net.train()
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
