"""Nerfacto-like unbounded-scene model (proposal sampler + hash-grid field, scene contraction).

One process per GPU via torch.multiprocessing.spawn:

    python train_360.py --data data/360_v2/bicycle --gpus 8 --out runs/bicycle
"""
import argparse
import json
import math
import os
import time

import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tinycudann as tcnn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.functional.image import structural_similarity_index_measure as ssim


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--downscale", type=int, default=4)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--rays", type=int, default=4096, help="global")
    p.add_argument("--n_prop", type=int, default=128)
    p.add_argument("--n_field", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eval_every", type=int, default=10000)
    p.add_argument("--holdout", type=int, default=8)
    return p.parse_args()


def contract(x):
    n = x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return torch.where(n <= 1, x, (2 - 1 / n) * x / n) / 2.0  # -> [-1, 1]


def hash_mlp(n_out, levels, log2_T, max_res, hidden, layers):
    return tcnn.NetworkWithInputEncoding(
        3, n_out,
        {"otype": "HashGrid", "n_levels": levels, "n_features_per_level": 2, "log2_hashmap_size": log2_T,
         "base_resolution": 16, "per_level_scale": math.exp(math.log(max_res / 16) / (levels - 1))},
        {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
         "n_neurons": hidden, "n_hidden_layers": layers})


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.prop = hash_mlp(1, 5, 17, 256, 16, 1)
        self.field = hash_mlp(16, 16, 19, 4096, 64, 1)
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.color = tcnn.Network(31, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                          "output_activation": "Sigmoid", "n_neurons": 64, "n_hidden_layers": 2})

    @staticmethod
    def weights(sigma, s):
        delta = s[..., 1:] - s[..., :-1]
        a = 1 - torch.exp(-sigma * delta)
        return a * torch.cumprod(torch.cat([torch.ones_like(a[..., :1]), 1 - a[..., :-1] + 1e-10], -1), -1)

    def forward(self, ro, rd, n_prop, n_field, near=0.05, far=1e3, perturb=True):
        R = ro.shape[0]
        # spacing function: linear in 1/t
        s = torch.linspace(0, 1, n_prop + 1, device=ro.device).expand(R, -1)
        if perturb:
            s = (s + torch.rand_like(s) / n_prop).clamp(max=1.0).sort(-1).values
        t = 1 / (1 / near * (1 - s) + 1 / far * s)
        mid = 0.5 * (t[:, 1:] + t[:, :-1])
        x = contract(ro[:, None] + rd[:, None] * mid[..., None]).reshape(-1, 3)
        sig_p = F.softplus(self.prop((x + 1) / 2).float()[:, 0] - 1).view(R, n_prop)
        w_p = self.weights(sig_p, t)
        with torch.no_grad():
            cdf = F.pad(torch.cumsum((w_p + 1e-4) / (w_p + 1e-4).sum(-1, keepdim=True), -1), (1, 0))
            u = torch.linspace(0, 1, n_field + 1, device=ro.device).expand(R, -1).contiguous()
            if perturb:
                u = (u + torch.rand_like(u[:, :1]) / (n_field + 1)).clamp(max=1 - 1e-6)
            i = torch.searchsorted(cdf, u, right=True).clamp(1, n_prop)
            c0, c1 = cdf.gather(1, i - 1), cdf.gather(1, i)
            s0, s1 = s.gather(1, i - 1), s.gather(1, i)
            s_f = s0 + (u - c0) / (c1 - c0).clamp_min(1e-8) * (s1 - s0)
        t_f = 1 / (1 / near * (1 - s_f) + 1 / far * s_f)
        mid_f = 0.5 * (t_f[:, 1:] + t_f[:, :-1])
        x = contract(ro[:, None] + rd[:, None] * mid_f[..., None]).reshape(-1, 3)
        h = self.field((x + 1) / 2).float()
        sig = F.softplus(h[:, 0] - 1).view(R, n_field)
        d = rd[:, None].expand(-1, n_field, -1).reshape(-1, 3)
        rgb = self.color(torch.cat([self.dir_enc((d + 1) / 2), h[:, 1:]], -1)).float().view(R, n_field, 3)
        w = self.weights(sig, t_f)
        out_rgb = (w[..., None] * rgb).sum(1)
        # proposal supervision: field weights binned into proposal intervals must be covered by w_p
        idx = torch.searchsorted(s.contiguous(), 0.5 * (s_f[:, 1:] + s_f[:, :-1]).contiguous()).clamp(1, n_prop) - 1
        w_bin = torch.zeros_like(w_p).scatter_add_(1, idx, w.detach())
        prop_loss = (F.relu(w_bin - w_p) ** 2 / (w_p + 1e-7)).sum(-1).mean()
        return out_rgb, prop_loss


def load_scene(root, downscale, holdout):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    frames = sorted(meta["frames"], key=lambda f: f["file_path"])
    imgs, c2ws = [], []
    for f in frames:
        im = Image.open(os.path.join(root, f["file_path"]))
        im = im.resize((im.width // downscale, im.height // downscale), Image.LANCZOS)
        imgs.append(np.asarray(im, np.float32)[..., :3] / 255.0)
        c2ws.append(np.array(f["transform_matrix"], np.float32))
    c2ws = np.stack(c2ws)
    c2ws[:, :3, 3] -= c2ws[:, :3, 3].mean(0)
    c2ws[:, :3, 3] /= np.abs(c2ws[:, :3, 3]).max()
    K = np.array([meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"]], np.float32) / downscale
    ids = np.arange(len(frames))
    return torch.from_numpy(np.stack(imgs)), torch.from_numpy(c2ws), torch.from_numpy(K), ids[ids % holdout != 0], ids[ids % holdout == 0]


def pixel_rays(c2w, K, x, y):
    d = torch.stack([(x + 0.5 - K[2]) / K[0], -(y + 0.5 - K[3]) / K[1], -torch.ones_like(x)], -1)
    rd = F.normalize((c2w[..., :3, :3] @ d[..., None]).squeeze(-1), dim=-1)
    return c2w[..., :3, 3].expand_as(rd), rd


def run(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(12345 + rank)

    imgs, c2ws, K, train_ids, test_ids = load_scene(args.data, args.downscale, args.holdout)
    H, W = imgs.shape[1:3]
    tr_imgs, tr_c2w, K = imgs[train_ids].to(device), c2ws[train_ids].to(device), K.to(device)

    model = DDP(Model().to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1, (it + 1) / 500) * 0.03 ** (it / args.steps))
    scaler = torch.cuda.amp.GradScaler()
    lpips_net = lpips.LPIPS(net="alex", verbose=False).to(device)
    n = args.rays // world
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    t0 = time.time()
    for it in range(1, args.steps + 1):
        i = torch.randint(0, tr_imgs.shape[0], (n,), device=device, generator=gen)
        x = torch.randint(0, W, (n,), device=device, generator=gen)
        y = torch.randint(0, H, (n,), device=device, generator=gen)
        ro, rd = pixel_rays(tr_c2w[i], K, x.float(), y.float())
        with torch.autocast("cuda", dtype=torch.float16):
            rgb, prop_loss = model(ro, rd, args.n_prop, args.n_field)
        loss = F.mse_loss(rgb.float(), tr_imgs[i, y, x]) + prop_loss.float()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if rank == 0 and it % 250 == 0:
            print(f"[{it}] loss {loss.item():.4f} ({(time.time() - t0) / it * 1000:.0f} ms/it)", flush=True)

        if it % args.eval_every == 0 or it == args.steps:
            net = model.module
            psnr_sum = ssim_sum = lpips_sum = 0.0
            count = 0
            yy, xx = torch.meshgrid(torch.arange(H, device=device).float(), torch.arange(W, device=device).float(), indexing="ij")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                for k in test_ids[rank::world]:
                    ro, rd = pixel_rays(c2ws[k].to(device).expand(H * W, 4, 4), K, xx.reshape(-1), yy.reshape(-1))
                    pred = torch.cat([net(ro[s:s + 8192], rd[s:s + 8192], args.n_prop, args.n_field, perturb=False)[0]
                                      for s in range(0, H * W, 8192)]).float().view(H, W, 3).clamp(0, 1)
                    gt = imgs[k].to(device)
                    p, g = pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]
                    psnr_sum += (-10 * torch.log10(F.mse_loss(pred, gt))).item()
                    ssim_sum += ssim(p, g, data_range=1.0).item()
                    lpips_sum += lpips_net(p * 2 - 1, g * 2 - 1).item()
                    count += 1
            totals = torch.tensor([psnr_sum, ssim_sum, lpips_sum, float(count)], dtype=torch.float64)
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
            if rank == 0:
                psnr, s_, lp, c = (totals[:3] / totals[3]).tolist() + [int(totals[3])]
                print(f"== eval {it}: PSNR {psnr:.2f} SSIM {s_:.4f} LPIPS {lp:.4f} ({c} views)", flush=True)
                with open(os.path.join(args.out, f"metrics_{it}.json"), "w") as f:
                    json.dump({"psnr": psnr, "ssim": s_, "lpips": lp, "views": c}, f)
                torch.save({"model": net.state_dict(), "it": it}, os.path.join(args.out, "model.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29507")
    mp.spawn(run, args=(args.gpus, args), nprocs=args.gpus, join=True)
