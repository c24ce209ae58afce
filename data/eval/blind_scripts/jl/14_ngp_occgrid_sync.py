"""Instant-NGP (tiny-cuda-nn + nerfacc) on Mip-NeRF 360 style unbounded-ish captures, DDP.

Each rank draws a dynamic number of rays so that all ranks together render about
`target_samples` samples per step; the occupancy grid is refreshed on every rank and merged with a MAX
all-reduce so that all ranks skip the same empty space.

    torchrun --nproc_per_node=4 14_ngp_occgrid_sync.py --data data/360_v2/bicycle --out runs/bicycle_ngp
"""
import argparse
import json
import math
import os

import numpy as np
import tinycudann as tcnn
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nerfacc import OccGridEstimator, rendering
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--target_samples", type=int, default=1 << 18)
    p.add_argument("--max_rays", type=int, default=1 << 14)
    p.add_argument("--grid_levels", type=int, default=4)
    p.add_argument("--grid_every", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def load_views(root, factor):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    ims, c2ws, Ks = [], [], []
    for fr in sorted(meta["frames"], key=lambda f: f["file_path"]):
        im = Image.open(os.path.join(root, fr["file_path"])).convert("RGB")
        im = im.resize((im.width // factor, im.height // factor), Image.BOX)
        ims.append(torch.from_numpy(np.asarray(im)).float() / 255.0)
        c2ws.append(torch.tensor(fr["transform_matrix"], dtype=torch.float32))
        Ks.append(torch.tensor([meta["fl_x"] / factor, meta["fl_y"] / factor, meta["cx"] / factor, meta["cy"] / factor]))
    c2ws = torch.stack(c2ws)
    # recentre and rescale the camera positions into [-1, 1]
    c2ws[:, :3, 3] -= c2ws[:, :3, 3].mean(0)
    c2ws[:, :3, 3] /= c2ws[:, :3, 3].abs().max()
    return torch.stack(ims), c2ws, torch.stack(Ks)


def gen_rays(c2w, K, x, y):
    d = torch.stack([(x + 0.5 - K[:, 2]) / K[:, 0], -(y + 0.5 - K[:, 3]) / K[:, 1], -torch.ones_like(K[:, 0])], -1)
    d = (c2w[:, :3, :3] @ d[..., None]).squeeze(-1)
    return c2w[:, :3, 3], F.normalize(d, dim=-1)


class Field(torch.nn.Module):
    def __init__(self, aabb):
        super().__init__()
        self.register_buffer("aabb", aabb)
        self.base = tcnn.NetworkWithInputEncoding(3, 16, {
            "otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2, "log2_hashmap_size": 21,
            "base_resolution": 16, "per_level_scale": math.exp(math.log(4096 * 4 / 16) / 15)},
            {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None", "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.head = tcnn.Network(16 + 15, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                              "output_activation": "Sigmoid", "n_neurons": 64, "n_hidden_layers": 2})

    def _contract(self, x):
        # scene contraction to the [-2, 2] ball, then into the unit cube of the hash grid
        mag = x.norm(dim=-1, keepdim=True)
        x = torch.where(mag < 1, x, (2 - 1 / mag) * (x / mag))
        return (x + 2.0) / 4.0

    def query_density(self, x, return_feat=False):
        h = self.base(self._contract(x).view(-1, 3)).float()
        sigma = F.softplus(h[:, :1] - 1.0)
        return (sigma, h[:, 1:]) if return_feat else sigma

    def forward(self, x, d):
        sigma, feat = self.query_density(x, return_feat=True)
        rgb = self.head(torch.cat([self.dir_enc((d + 1) / 2), feat], -1)).float()
        return rgb, sigma


def render(field, estimator, ro, rd, step_size, bg, train, density_fn=None):
    density_fn = density_fn or field.query_density

    def sigma_fn(t0, t1, ri):
        return density_fn(ro[ri] + rd[ri] * ((t0 + t1) / 2)[:, None]).squeeze(-1)

    def rgb_sigma_fn(t0, t1, ri):
        rgb, sigma = field(ro[ri] + rd[ri] * ((t0 + t1) / 2)[:, None], rd[ri])
        return rgb, sigma.squeeze(-1)

    ri, t0, t1 = estimator.sampling(ro, rd, sigma_fn=sigma_fn, near_plane=0.05, render_step_size=step_size,
                                    stratified=train, alpha_thre=1e-2 if not train else 0.0, cone_angle=0.004)
    rgb, acc, _, _ = rendering(t0, t1, ri, n_rays=ro.shape[0], rgb_sigma_fn=rgb_sigma_fn, render_bkgd=bg)
    return rgb, t0.shape[0]


@torch.no_grad()
def sync_grid(estimator, occ_thre=1e-2):
    dist.all_reduce(estimator.occs, op=dist.ReduceOp.MAX)
    thre = torch.clamp(estimator.occs[estimator.occs >= 0].mean(), max=occ_thre)
    estimator.binaries = (estimator.occs > thre).view(estimator.binaries.shape)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    ims, c2ws, Ks = load_views(args.data, args.factor)
    test_ids = list(range(0, len(ims), 8))
    train_ids = torch.tensor([i for i in range(len(ims)) if i % 8], device=dev)
    ims, c2ws, Ks = ims.to(dev), c2ws.to(dev), Ks.to(dev)
    H, W = ims.shape[1:3]

    aabb = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0], device=dev)
    step_size = 1.7320508 * 2 / 1024
    estimator = OccGridEstimator(roi_aabb=aabb, resolution=128, levels=args.grid_levels).to(dev)
    field = Field(aabb).to(dev)
    start = 0
    ckpt_path = os.path.join(args.out, "ngp.ckpt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        field.load_state_dict(ck["field"])
        estimator.load_state_dict(ck["estimator"])
        start = ck["step"]
    # the aabb buffer never changes, nothing to broadcast each step
    model = DDP(field, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-15)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.steps * f) for f in (0.5, 0.75, 0.9)], gamma=0.33)
    if args.resume and start > 0:
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
    lpips_fn = LearnedPerceptualImagePatchSimilarity(net_type="vgg", normalize=True).to(dev)

    n_rays = 4096
    target_local = args.target_samples // world
    for step in range(start, args.steps):
        model.train()
        estimator.update_every_n_steps(step=step, occ_eval_fn=lambda x: field.query_density(x) * step_size,
                                       occ_thre=1e-2, n=args.grid_every)
        if step % args.grid_every == 0:
            sync_grid(estimator)

        pick = train_ids[torch.randint(len(train_ids), (n_rays,), device=dev)]
        x, y = torch.randint(W, (n_rays,), device=dev), torch.randint(H, (n_rays,), device=dev)
        ro, rd = gen_rays(c2ws[pick], Ks[pick], x.float(), y.float())
        target = ims[pick, y, x]
        bg = torch.rand(3, device=dev)
        # gradients flow through the DDP wrapper; density lookups for the sampler are no-grad
        rgb, n_samples = render(model, estimator, ro, rd, step_size, bg, train=True, density_fn=field.query_density)
        loss = F.smooth_l1_loss(rgb, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        n_rays = int(min(args.max_rays, max(256, n_rays * target_local / max(n_samples, 1))))

        if step % 500 == 0:
            s = torch.stack([loss.detach(), torch.tensor(float(n_samples), device=dev)])
            dist.all_reduce(s, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step:6d} loss {s[0]:.5f} samples/rank {s[1]:.0f} rays(rank0) {n_rays}", flush=True)

        if (step + 1) % 5000 == 0 or step + 1 == args.steps:
            model.eval()
            tot = torch.zeros(3, device=dev)
            with torch.no_grad():
                for i in test_ids[rank::world]:
                    yy, xx = torch.meshgrid(torch.arange(H, device=dev), torch.arange(W, device=dev), indexing="ij")
                    idx = torch.full((H * W,), i, device=dev)
                    ro, rd = gen_rays(c2ws[idx], Ks[idx], xx.flatten().float(), yy.flatten().float())
                    out = torch.cat([render(field, estimator, ro[s:s + 16384], rd[s:s + 16384], step_size,
                                            torch.zeros(3, device=dev), train=False)[0] for s in range(0, H * W, 16384)])
                    p, g = out.view(H, W, 3).permute(2, 0, 1)[None].clamp(0, 1), ims[i].permute(2, 0, 1)[None]
                    tot += torch.stack([-10 * torch.log10(F.mse_loss(p, g)), lpips_fn(p, g), torch.ones((), device=dev)])
            dist.all_reduce(tot)
            if rank == 0:
                print(f"[test] step {step + 1}: PSNR {tot[0] / tot[2]:.2f}  LPIPS {tot[1] / tot[2]:.4f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"field": field.state_dict(), "estimator": estimator.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step + 1}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
