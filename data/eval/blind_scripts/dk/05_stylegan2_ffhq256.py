"""
StyleGAN2 (config-f, 256px) on FFHQ with DDP.

    torchrun --nnodes=1 --nproc_per_node=8 train_stylegan2.py --config configs/ffhq256.yaml
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from scipy import linalg
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import save_image

from stylegan2.networks import Discriminator, Generator
from metrics.inception import InceptionFeatureExtractor


DEFAULTS = dict(
    resolution=256, z_dim=512, w_dim=512, mapping_layers=8, channel_base=32768,
    batch_gpu=8, lr=0.0025, r1_gamma=10.0, d_reg_every=16, g_reg_every=4,
    pl_weight=2.0, pl_decay=0.01, pl_batch_shrink=2, style_mixing_prob=0.9,
    ema_kimg=10.0, total_kimg=25000, log_every=100, snapshot_every=5000, fid_every=10000,
    fid_num=50000, num_workers=6, seed=0,
)


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for img, _ in loader:
            yield img
        epoch += 1


def run_G(G, z, mixing_prob):
    ws = G.mapping(z, None)
    if mixing_prob > 0:
        cutoff = torch.empty([], dtype=torch.int64, device=ws.device).random_(1, ws.shape[1])
        cutoff = torch.where(torch.rand([], device=ws.device) < mixing_prob, cutoff, torch.full_like(cutoff, ws.shape[1]))
        ws[:, cutoff:] = G.mapping(torch.randn_like(z), None, skip_w_avg_update=True)[:, cutoff:]
    img = G.synthesis(ws)
    return img, ws


@torch.no_grad()
def ema_step(G_ema, G, beta):
    for p_ema, p in zip(G_ema.parameters(), G.parameters()):
        p_ema.copy_(p.lerp(p_ema, beta))
    for b_ema, b in zip(G_ema.buffers(), G.buffers()):
        b_ema.copy_(b)


@torch.no_grad()
def fid50k(G_ema, extractor, ref_mu, ref_sigma, cfg, device, rank, world_size):
    n_local = math.ceil(cfg.fid_num / world_size)
    feats = []
    done = 0
    while done < n_local:
        b = min(64, n_local - done)
        z = torch.randn(b, cfg.z_dim, device=device)
        img = G_ema(z, None, noise_mode="const")
        feats.append(extractor(img))
        done += b
    local = torch.cat(feats)
    out = torch.empty(world_size * local.shape[0], local.shape[1], device=device, dtype=local.dtype)
    dist.all_gather_into_tensor(out, local)
    if rank != 0:
        return None
    x = out[: cfg.fid_num].double().cpu().numpy()
    mu, sigma = x.mean(0), np.cov(x, rowvar=False)
    covmean, _ = linalg.sqrtm(sigma.dot(ref_sigma), disp=False)
    return float(((mu - ref_mu) ** 2).sum() + np.trace(sigma + ref_sigma - 2 * covmean.real))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--data", default="/datasets/ffhq/images256x256")
    parser.add_argument("--ref_stats", default="/datasets/ffhq/fid_stats_256.npz")
    parser.add_argument("--run_dir", default="runs/stylegan2-ffhq256")
    parser.add_argument("--resume", default=None)
    a = parser.parse_args()
    cfg = load_config(a.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    torch.manual_seed(cfg.seed)
    G = Generator(z_dim=cfg.z_dim, w_dim=cfg.w_dim, img_resolution=cfg.resolution,
                  mapping_layers=cfg.mapping_layers, channel_base=cfg.channel_base).to(device)
    D = Discriminator(img_resolution=cfg.resolution, channel_base=cfg.channel_base).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)

    g_ratio = cfg.g_reg_every / (cfg.g_reg_every + 1)
    d_ratio = cfg.d_reg_every / (cfg.d_reg_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=cfg.lr * g_ratio, betas=(0.0, 0.99 ** g_ratio), eps=1e-8)
    opt_D = torch.optim.Adam(D.parameters(), lr=cfg.lr * d_ratio, betas=(0.0, 0.99 ** d_ratio), eps=1e-8)

    step = 0
    if a.resume:
        state = torch.load(a.resume, map_location="cpu")
        G.load_state_dict(state["G"])
        D.load_state_dict(state["D"])
        G_ema.load_state_dict(state["G_ema"])
        opt_G.load_state_dict(state["opt_G"])
        opt_D.load_state_dict(state["opt_D"])
        step = state["step"]

    G = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    torch.manual_seed(cfg.seed * world_size + rank)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    dataset = datasets.ImageFolder(a.data, transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.batch_gpu, sampler=sampler, num_workers=cfg.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    data = infinite(loader, sampler)

    extractor = InceptionFeatureExtractor().to(device).eval()
    ref = np.load(a.ref_stats)
    writer = None
    if rank == 0:
        os.makedirs(a.run_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(a.run_dir, "tb"))
    grid_z = torch.randn(32, cfg.z_dim, device=device)

    global_batch = cfg.batch_gpu * world_size
    total_steps = cfg.total_kimg * 1000 // global_batch
    ema_beta = 0.5 ** (global_batch / (cfg.ema_kimg * 1000))
    pl_mean = torch.zeros([], device=device)

    while step < total_steps:
        real = next(data).to(device, non_blocking=True)
        do_r1 = step % cfg.d_reg_every == 0
        do_pl = step % cfg.g_reg_every == 0

        # -------- D: main loss, with R1 folded into the same pass on reg steps --------
        G.requires_grad_(False)
        D.requires_grad_(True)
        z = torch.randn(cfg.batch_gpu, cfg.z_dim, device=device)
        with torch.no_grad():
            fake, _ = run_G(G, z, cfg.style_mixing_prob)
        real.requires_grad_(do_r1)
        real_logits = D(real, None)
        fake_logits = D(fake, None)
        loss_D = F.softplus(fake_logits).mean() + F.softplus(-real_logits).mean()
        loss_r1 = torch.zeros([], device=device)
        if do_r1:
            (r1_grads,) = torch.autograd.grad(real_logits.sum(), real, create_graph=True)
            loss_r1 = r1_grads.square().sum([1, 2, 3]).mean() * (cfg.r1_gamma / 2) * cfg.d_reg_every
        opt_D.zero_grad(set_to_none=True)
        (loss_D + loss_r1).backward()
        opt_D.step()

        # -------- G: non-saturating loss --------
        G.requires_grad_(True)
        D.requires_grad_(False)
        z = torch.randn(cfg.batch_gpu, cfg.z_dim, device=device)
        fake, _ = run_G(G, z, cfg.style_mixing_prob)
        loss_G = F.softplus(-D(fake, None)).mean()
        opt_G.zero_grad(set_to_none=True)
        loss_G.backward()
        opt_G.step()

        # -------- G: lazy path-length regularisation --------
        loss_pl = torch.zeros([], device=device)
        if do_pl:
            bs = max(1, cfg.batch_gpu // cfg.pl_batch_shrink)
            z = torch.randn(bs, cfg.z_dim, device=device)
            img, ws = run_G(G, z, cfg.style_mixing_prob)
            noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
            (grads,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
            lengths = grads.square().sum(2).mean(1).sqrt()
            pl_mean_new = pl_mean.lerp(lengths.mean(), cfg.pl_decay)
            pl_mean.copy_(pl_mean_new.detach())
            loss_pl = (lengths - pl_mean_new).square().mean() * cfg.pl_weight * cfg.g_reg_every
            opt_G.zero_grad(set_to_none=True)
            (loss_pl + img[:, 0, 0, 0].sum() * 0).backward()
            opt_G.step()

        ema_step(G_ema, G.module, ema_beta)
        step += 1

        if step % cfg.log_every == 0:
            logs = torch.stack([loss_D.detach(), loss_G.detach(), loss_r1.detach(), loss_pl.detach()])
            dist.all_reduce(logs, op=dist.ReduceOp.AVG)
            if rank == 0:
                for name, v in zip(["loss/D", "loss/G", "loss/r1", "loss/pl"], logs.tolist()):
                    writer.add_scalar(name, v, step)
                print(f"step {step}/{total_steps} kimg {step * global_batch / 1000:.1f} "
                      f"D {logs[0]:.3f} G {logs[1]:.3f}", flush=True)

        if step % cfg.snapshot_every == 0 and rank == 0:
            with torch.no_grad():
                save_image(G_ema(grid_z, None, noise_mode="const"), os.path.join(a.run_dir, f"fakes{step:07d}.png"),
                           nrow=8, normalize=True, value_range=(-1, 1))
            torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                        "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(), "step": step},
                       os.path.join(a.run_dir, f"snapshot-{step:07d}.pt"))

        if step % cfg.fid_every == 0:
            fid = fid50k(G_ema, extractor, ref["mu"], ref["sigma"], cfg, device, rank, world_size)
            if rank == 0:
                writer.add_scalar("metrics/fid50k", fid, step)
                print(f"step {step}: FID {fid:.2f}", flush=True)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
