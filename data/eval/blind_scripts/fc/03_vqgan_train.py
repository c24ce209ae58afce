# VQGAN (f16, 16384 codes) training: L1 + LPIPS + hinge PatchGAN loss with adaptive weight.
#
#   torchrun --standalone --nproc_per_node=8 03_vqgan_train.py --config configs/vqgan_f16_16384.yaml
import argparse
import os
import time

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from lab_data import ImageDataset
from lab_models.vqgan_blocks import Decoder, Encoder, NLayerDiscriminator, weights_init


class VectorQuantizer(nn.Module):
    def __init__(self, n_e, e_dim, beta=0.25):
        super().__init__()
        self.n_e, self.e_dim, self.beta = n_e, e_dim, beta
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)

    def forward(self, z):
        z = z.permute(0, 2, 3, 1).contiguous()
        zf = z.view(-1, self.e_dim)
        d = zf.pow(2).sum(1, keepdim=True) + self.embedding.weight.pow(2).sum(1) - 2 * zf @ self.embedding.weight.t()
        idx = d.argmin(1)
        zq = self.embedding(idx).view(z.shape)
        loss = self.beta * (zq.detach() - z).pow(2).mean() + (zq - z.detach()).pow(2).mean()
        zq = z + (zq - z).detach()
        return zq.permute(0, 3, 1, 2).contiguous(), loss, idx


class VQModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(**cfg["ddconfig"])
        self.decoder = Decoder(**cfg["ddconfig"])
        self.quantize = VectorQuantizer(cfg["n_embed"], cfg["embed_dim"])
        self.quant_conv = nn.Conv2d(cfg["ddconfig"]["z_channels"], cfg["embed_dim"], 1)
        self.post_quant_conv = nn.Conv2d(cfg["embed_dim"], cfg["ddconfig"]["z_channels"], 1)

    def forward(self, x):
        h = self.quant_conv(self.encoder(x))
        zq, qloss, idx = self.quantize(h)
        return self.decoder(self.post_quant_conv(zq)), qloss, idx

    def get_last_layer(self):
        return self.decoder.conv_out.weight


def hinge_d_loss(logits_real, logits_fake):
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def adaptive_weight(nll_loss, g_loss, last_layer, max_w=1e4):
    nll_grads = torch.autograd.grad(nll_loss, last_layer, retain_graph=True)[0]
    g_grads = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    w = torch.norm(nll_grads) / (torch.norm(g_grads) + 1e-4)
    return torch.clamp(w, 0.0, max_w).detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    tc = cfg["train"]

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    ds = ImageDataset(tc["data_root"], size=tc["resolution"], random_crop=True)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=tc["batch_size"], sampler=sampler, num_workers=tc.get("workers", 8),
                    pin_memory=True, drop_last=True)

    vq = VQModel(cfg["model"]).to(device)
    disc = NLayerDiscriminator(input_nc=3, n_layers=3, use_actnorm=False).apply(weights_init)
    disc = nn.SyncBatchNorm.convert_sync_batchnorm(disc).to(device)
    perceptual = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)

    model = DDP(vq, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    lr = tc["base_lr"] * tc["batch_size"] * world
    opt_ae = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.9))

    start_epoch, step = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        disc.module.load_state_dict(ck["disc"])
        opt_ae.load_state_dict(ck["opt_ae"])
        opt_d.load_state_dict(ck["opt_d"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]

    writer = SummaryWriter(os.path.join(tc["out"], "tb")) if rank == 0 else None
    disc_start = tc["disc_start"]
    disc_w = tc.get("disc_weight", 0.8)
    perc_w = tc.get("perceptual_weight", 1.0)

    for epoch in range(start_epoch, tc["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        disc.train()
        t0 = time.time()
        for x in dl:
            x = x.to(device, non_blocking=True)
            xrec, qloss, idx = model(x)

            rec = (x - xrec).abs() + perc_w * perceptual(x, xrec)
            nll = rec.mean()
            if step >= disc_start:
                g_loss = -disc(xrec).mean()
                d_weight = adaptive_weight(nll, g_loss, model.get_last_layer()) * disc_w
            else:
                g_loss = torch.zeros((), device=device)
                d_weight = torch.zeros((), device=device)
            loss_ae = nll + qloss.mean() + d_weight * g_loss

            opt_ae.zero_grad(set_to_none=True)
            loss_ae.backward()
            opt_ae.step()

            if step >= disc_start:
                logits_real = disc(x.detach())
                logits_fake = disc(xrec.detach())
                d_loss = hinge_d_loss(logits_real, logits_fake)
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()
            else:
                d_loss = torch.zeros((), device=device)

            step += 1
            if step % 50 == 0:
                stats = torch.stack([nll.detach(), qloss.detach(), g_loss.detach(), d_loss.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                used = torch.bincount(idx, minlength=cfg["model"]["n_embed"]).clamp_(max=1)
                dist.all_reduce(used, op=dist.ReduceOp.MAX)
                if rank == 0:
                    n_used = int(used.sum())
                    writer.add_scalar("train/nll", stats[0].item(), step)
                    writer.add_scalar("train/qloss", stats[1].item(), step)
                    writer.add_scalar("train/g_loss", stats[2].item(), step)
                    writer.add_scalar("train/d_loss", stats[3].item(), step)
                    writer.add_scalar("train/codes_used", n_used, step)
                    print(f"[{epoch}:{step}] nll {stats[0]:.4f} q {stats[1]:.4f} g {stats[2]:.4f} "
                          f"d {stats[3]:.4f} codes {n_used} ({time.time() - t0:.1f}s)", flush=True)
                    t0 = time.time()

        if rank == 0:
            os.makedirs(tc["out"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "disc": disc.module.state_dict(),
                        "opt_ae": opt_ae.state_dict(), "opt_d": opt_d.state_dict(),
                        "epoch": epoch, "step": step, "config": cfg},
                       os.path.join(tc["out"], "last.ckpt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
