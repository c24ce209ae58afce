"""StyleGAN2-ADA style training loop for small datasets (BreCaHAD 512x512 crops).

Gradients are averaged by hand (flattened all-reduce per phase) instead of wrapping
G and D in DDP, the same way the official ADA code does it.

    torchrun --standalone --nproc_per_node=4 train_ada.py --data /data/brecahad512 --batch 32
"""
import argparse
import copy
import os
import time

import numpy as np
import scipy.linalg
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from networks import AugmentPipe, Discriminator, Generator


class ImageDataset(torch.utils.data.Dataset):
    def __init__(self, root, xflip=True):
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.lower().endswith((".png", ".jpg")))
        self.xflip = xflip

    def __len__(self):
        return len(self.files) * (2 if self.xflip else 1)

    def __getitem__(self, idx):
        img = np.array(Image.open(self.files[idx % len(self.files)]).convert("RGB")).transpose(2, 0, 1)
        if idx >= len(self.files):
            img = img[:, :, ::-1]
        return torch.from_numpy(img.copy())


class InfiniteSampler(torch.utils.data.Sampler):
    """Endless, rank-strided sampler. Every rank uses the same seed, so the shards never overlap."""

    def __init__(self, dataset, rank=0, num_replicas=1, shuffle=True, seed=0, window_size=0.5):
        super().__init__(dataset)
        self.dataset = dataset
        self.rank = rank
        self.num_replicas = num_replicas
        self.shuffle = shuffle
        self.seed = seed
        self.window_size = window_size

    def __iter__(self):
        order = np.arange(len(self.dataset))
        rnd = None
        window = 0
        if self.shuffle:
            rnd = np.random.RandomState(self.seed)
            rnd.shuffle(order)
            window = int(np.rint(order.size * self.window_size))
        idx = 0
        while True:
            i = idx % order.size
            if idx % self.num_replicas == self.rank:
                yield order[i]
            if window >= 2:
                j = (i - rnd.randint(window)) % order.size
                order[i], order[j] = order[j], order[i]
            idx += 1


def params_and_buffers(module):
    return list(module.parameters()) + list(module.buffers())


@torch.no_grad()
def broadcast_module(module):
    for t in params_and_buffers(module):
        dist.broadcast(t, src=0)


def sync_grads(module, world_size):
    params = [p for p in module.parameters() if p.grad is not None]
    if len(params) == 0:
        return
    flat = torch.cat([p.grad.flatten() for p in params])
    if world_size > 1:
        dist.all_reduce(flat)
        flat /= world_size
    torch.nan_to_num(flat, nan=0, posinf=1e5, neginf=-1e5, out=flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.reshape(p.shape)


@torch.no_grad()
def compute_fid(G_ema, detector, mu_real, sigma_real, num_gen, batch_gen, device, rank, world_size):
    feats = []
    for _ in range(0, num_gen, batch_gen * world_size):
        z = torch.randn(batch_gen, G_ema.z_dim, device=device)
        c = torch.zeros(batch_gen, G_ema.c_dim, device=device)
        img = G_ema(z, c, noise_mode="const")
        img = (img * 127.5 + 128).clamp(0, 255).to(torch.uint8)
        f = detector(img, return_features=True)
        gathered = [torch.empty_like(f) for _ in range(world_size)]
        dist.all_gather(gathered, f)
        if rank == 0:
            feats.append(torch.cat(gathered).cpu())
    if rank != 0:
        return None
    feats = torch.cat(feats)[:num_gen].double().numpy()
    mu, sigma = feats.mean(0), np.cov(feats, rowvar=False)
    m = np.square(mu - mu_real).sum()
    s, _ = scipy.linalg.sqrtm(np.dot(sigma, sigma_real), disp=False)
    return float(np.real(m + np.trace(sigma + sigma_real - s * 2)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--outdir", default="training-runs/brecahad")
    p.add_argument("--batch", type=int, default=32, help="total batch size over all GPUs")
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--pl_weight", type=float, default=2.0)
    p.add_argument("--pl_batch_shrink", type=int, default=2)
    p.add_argument("--G_reg_interval", type=int, default=4)
    p.add_argument("--D_reg_interval", type=int, default=16)
    p.add_argument("--style_mixing", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=0.0025)
    p.add_argument("--ema_kimg", type=float, default=10.0)
    p.add_argument("--ada_target", type=float, default=0.6)
    p.add_argument("--ada_interval", type=int, default=4)
    p.add_argument("--ada_kimg", type=int, default=500)
    p.add_argument("--kimg", type=int, default=25000)
    p.add_argument("--tick_kimg", type=int, default=4)
    p.add_argument("--snap", type=int, default=50, help="ticks between snapshots / FID")
    p.add_argument("--fid_stats", default="stats/brecahad512.npz")
    p.add_argument("--detector", default="inception-2015-12-05.pt")
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=3)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.batch % world_size == 0
    batch_gpu = args.batch // world_size

    np.random.seed(args.seed * world_size + rank)
    torch.manual_seed(args.seed * world_size + rank)
    torch.backends.cudnn.benchmark = True

    dataset = ImageDataset(args.data)
    sampler = InfiniteSampler(dataset, rank=rank, num_replicas=world_size, seed=args.seed)
    data_iter = iter(torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=batch_gpu,
                                                 num_workers=args.workers, pin_memory=True, prefetch_factor=2))

    G = Generator(z_dim=512, w_dim=512, c_dim=0, img_resolution=512).train().requires_grad_(False).to(device)
    D = Discriminator(c_dim=0, img_resolution=512).train().requires_grad_(False).to(device)
    G_ema = copy.deepcopy(G).eval()
    augment_pipe = AugmentPipe(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1,
                               brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1).train().to(device)
    augment_pipe.p.zero_()

    cur_nimg = 0
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ckpt["G"])
        D.load_state_dict(ckpt["D"])
        G_ema.load_state_dict(ckpt["G_ema"])
        augment_pipe.p.copy_(torch.as_tensor(ckpt["augment_p"]))
        cur_nimg = ckpt["cur_nimg"]
        del ckpt
    for module in (G, D, G_ema, augment_pipe):
        broadcast_module(module)

    phases = []
    for name, module, interval in (("G", G, args.G_reg_interval), ("D", D, args.D_reg_interval)):
        ratio = interval / (interval + 1)
        opt = torch.optim.Adam(module.parameters(), lr=args.lr * ratio, betas=(0 ** ratio, 0.99 ** ratio), eps=1e-8)
        phases.append(dict(name=name + "main", module=module, opt=opt, interval=1))
        phases.append(dict(name=name + "reg", module=module, opt=opt, interval=interval))

    pl_mean = torch.zeros([], device=device)
    ada_stats = torch.zeros(2, device=device)

    def run_G(z, c):
        ws = G.mapping(z, c)
        cutoff = torch.empty([], dtype=torch.int64, device=device).random_(1, ws.shape[1])
        cutoff = torch.where(torch.rand([], device=device) < args.style_mixing, cutoff, torch.full_like(cutoff, ws.shape[1]))
        ws[:, cutoff:] = G.mapping(torch.randn_like(z), c, skip_w_avg_update=True)[:, cutoff:]
        return G.synthesis(ws), ws

    def run_D(img, c):
        return D(augment_pipe(img), c)

    stats = np.load(args.fid_stats)
    detector = torch.jit.load(args.detector, map_location=device).eval()
    writer = SummaryWriter(args.outdir) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)

    batch_idx = 0
    tick = 0
    tick_start_nimg = cur_nimg
    tick_start_time = time.time()
    while True:
        real_img = next(data_iter).to(device, non_blocking=True).float() / 127.5 - 1
        real_c = torch.zeros(batch_gpu, 0, device=device)
        gen_z = torch.randn(batch_gpu, G.z_dim, device=device)
        losses = {}

        for phase in phases:
            if batch_idx % phase["interval"] != 0:
                continue
            module, opt, name, gain = phase["module"], phase["opt"], phase["name"], phase["interval"]
            opt.zero_grad(set_to_none=True)
            module.requires_grad_(True)

            if name == "Gmain":
                gen_img, _ = run_G(gen_z, real_c)
                loss = F.softplus(-run_D(gen_img, real_c)).mean()
            elif name == "Greg":
                bs = batch_gpu // args.pl_batch_shrink
                gen_img, gen_ws = run_G(gen_z[:bs], real_c[:bs])
                pl_noise = torch.randn_like(gen_img) / np.sqrt(gen_img.shape[2] * gen_img.shape[3])
                pl_grads = torch.autograd.grad(outputs=[(gen_img * pl_noise).sum()], inputs=[gen_ws], create_graph=True)[0]
                pl_lengths = pl_grads.square().sum(2).mean(1).sqrt()
                pl_mean_new = pl_mean.lerp(pl_lengths.mean(), 0.01)
                pl_mean.copy_(pl_mean_new.detach())
                loss = (gen_img[:, 0, 0, 0] * 0 + (pl_lengths - pl_mean_new).square() * args.pl_weight).mean()
            elif name == "Dmain":
                with torch.no_grad():
                    gen_img, _ = run_G(gen_z, real_c)
                gen_logits = run_D(gen_img, real_c)
                real_logits = run_D(real_img, real_c)
                ada_stats += torch.stack([real_logits.detach().sign().sum(), real_logits.new_tensor(real_logits.numel())])
                loss = F.softplus(gen_logits).mean() + F.softplus(-real_logits).mean()
            else:  # Dreg
                real_tmp = real_img.detach().requires_grad_(True)
                real_logits = run_D(real_tmp, real_c)
                r1_grads = torch.autograd.grad(outputs=[real_logits.sum()], inputs=[real_tmp], create_graph=True)[0]
                r1_penalty = r1_grads.square().sum([1, 2, 3])
                loss = (real_logits * 0 + r1_penalty * (args.gamma / 2)).mean()

            loss.mul(gain).backward()
            module.requires_grad_(False)
            sync_grads(module, world_size)
            opt.step()
            losses[name] = loss.detach()

        # EMA
        ema_nimg = args.ema_kimg * 1000
        ema_beta = 0.5 ** (args.batch / max(ema_nimg, 1e-8))
        with torch.no_grad():
            for p_ema, p_g in zip(G_ema.parameters(), G.parameters()):
                p_ema.copy_(p_g.lerp(p_ema, ema_beta))
            for b_ema, b in zip(G_ema.buffers(), G.buffers()):
                b_ema.copy_(b)

        cur_nimg += args.batch
        batch_idx += 1

        # ADA: every rank sees the same reduced statistic, so p stays identical everywhere
        if batch_idx % args.ada_interval == 0:
            dist.all_reduce(ada_stats)
            rt = (ada_stats[0] / ada_stats[1]).item()
            adjust = np.sign(rt - args.ada_target) * (args.batch * args.ada_interval) / (args.ada_kimg * 1000)
            augment_pipe.p.copy_((augment_pipe.p + adjust).clamp_(min=0))
            ada_stats.zero_()

        done = cur_nimg >= args.kimg * 1000
        if not done and cur_nimg < tick_start_nimg + args.tick_kimg * 1000:
            continue

        keys = sorted(losses)
        vals = torch.stack([losses[k] for k in keys])
        dist.all_reduce(vals)
        vals /= world_size
        if rank == 0:
            sec = time.time() - tick_start_time
            print(f"tick {tick} kimg {cur_nimg / 1000:.1f} sec/kimg {sec / ((cur_nimg - tick_start_nimg) / 1000):.2f} "
                  f"augment {augment_pipe.p.item():.3f}", flush=True)
            for k, v in zip(keys, vals.tolist()):
                writer.add_scalar(f"Loss/{k}", v, cur_nimg // 1000)
            writer.add_scalar("Progress/augment", augment_pipe.p.item(), cur_nimg // 1000)

        if done or tick % args.snap == 0:
            fid = compute_fid(G_ema, detector, stats["mu"], stats["sigma"], 50000, 32, device, rank, world_size)
            if rank == 0:
                writer.add_scalar("Metrics/fid50k_full", fid, cur_nimg // 1000)
                torch.save({"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                            "augment_p": augment_pipe.p.item(), "cur_nimg": cur_nimg, "fid": fid},
                           os.path.join(args.outdir, f"network-snapshot-{cur_nimg // 1000:06d}.pt"))

        tick += 1
        tick_start_nimg = cur_nimg
        tick_start_time = time.time()
        if done:
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
