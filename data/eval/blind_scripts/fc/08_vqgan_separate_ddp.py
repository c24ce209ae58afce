"""VQGAN f8 tokenizer for 256px (OpenImages) - autoencoder and discriminator as separate DDP modules.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        08_vqgan_separate_ddp.py --config configs/vqgan_f8_oi.yaml --workdir /shared/exp/vqgan_f8_oi
"""
import argparse
import math
import os

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from lab_data.openimages import OpenImagesCrops
from lab_models.vqgan_blocks import Decoder, Encoder, NLayerDiscriminator, weights_init
from lab_models.quantizers import VectorQuantizer2


class VQGAN(nn.Module):
    def __init__(self, mcfg):
        super().__init__()
        self.encoder = Encoder(**mcfg.ddconfig)
        self.decoder = Decoder(**mcfg.ddconfig)
        self.quantize = VectorQuantizer2(mcfg.n_embed, mcfg.embed_dim, beta=0.25)
        self.quant_conv = nn.Conv2d(mcfg.ddconfig.z_channels, mcfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(mcfg.embed_dim, mcfg.ddconfig.z_channels, 1)

    def forward(self, x):
        zq, qloss, (_, _, idx) = self.quantize(self.quant_conv(self.encoder(x)))
        return self.decoder(self.post_quant_conv(zq)), qloss, idx

    def last_layer(self):
        return self.decoder.conv_out.weight


def adopt_weight(weight, step, threshold):
    return weight if step >= threshold else 0.0


def calc_adaptive_weight(nll, g_loss, last_layer):
    g1 = torch.autograd.grad(nll, last_layer, retain_graph=True)[0]
    g2 = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    return (g1.norm() / (g2.norm() + 1e-4)).clamp(0.0, 1e4).detach()


@torch.no_grad()
def validate(ae, perceptual, loader, device, n_embed):
    ae.eval()
    sums = torch.zeros(3, device=device)  # l1 sum, lpips sum, count
    used = torch.zeros(n_embed, device=device)
    for x in loader:
        x = x.to(device, non_blocking=True)
        xr, _, idx = ae.module(x)
        sums[0] += (xr - x).abs().mean(dim=(1, 2, 3)).sum()
        sums[1] += perceptual(xr, x).flatten().sum()
        sums[2] += x.shape[0]
        used[idx.flatten().unique()] = 1
    dist.all_reduce(sums)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    ae.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), int(used.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    cfg = OmegaConf.load(args.config)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    train_ds = OpenImagesCrops(cfg.data.root, split="train", size=cfg.data.size)
    val_ds = OpenImagesCrops(cfg.data.root, split="validation", size=cfg.data.size, random_crop=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                          num_workers=cfg.data.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    # strided shard without padding, so every validation image is counted exactly once
    val_part = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_dl = DataLoader(val_part, batch_size=cfg.train.batch_size, shuffle=False, num_workers=4)

    ae = VQGAN(cfg.model).to(device)
    disc = NLayerDiscriminator(input_nc=3, n_layers=3).apply(weights_init).to(device)
    disc = nn.SyncBatchNorm.convert_sync_batchnorm(disc)
    ae = DDP(ae, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank], broadcast_buffers=False)
    perceptual = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)

    # lr scaled with the global batch, as in taming-transformers
    lr = cfg.train.base_lr * world * cfg.train.batch_size
    opt_ae = torch.optim.Adam(ae.parameters(), lr=lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.9))

    os.makedirs(args.workdir, exist_ok=True)
    ckpt_path = os.path.join(args.workdir, "last.ckpt")
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        ae.module.load_state_dict(ck["ae"])
        disc.module.load_state_dict(ck["disc"])
        opt_ae.load_state_dict(ck["opt_ae"])
        opt_d.load_state_dict(ck["opt_d"])
        step, start_epoch = ck["step"], ck["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}", flush=True)

    tb = SummaryWriter(os.path.join(args.workdir, "tb")) if rank == 0 else None
    disc_start = cfg.loss.disc_start

    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            xr, qloss, _ = ae(x)
            nll = (x - xr).abs().mean() + cfg.loss.perceptual_weight * perceptual(x, xr).mean()
            d_factor = adopt_weight(cfg.loss.disc_factor, step, disc_start)
            if d_factor > 0:
                g_loss = -disc(xr).mean()
                d_weight = calc_adaptive_weight(nll, g_loss, ae.module.last_layer()) * cfg.loss.disc_weight
                loss = nll + cfg.loss.codebook_weight * qloss + d_weight * d_factor * g_loss
            else:
                g_loss = torch.zeros((), device=device)
                loss = nll + cfg.loss.codebook_weight * qloss
            opt_ae.zero_grad(set_to_none=True)
            loss.backward()
            opt_ae.step()

            if d_factor > 0:
                # one forward over real and fake together
                logits = disc(torch.cat([x, xr.detach()], dim=0))
                lr_, lf_ = logits.chunk(2, dim=0)
                d_loss = d_factor * 0.5 * (F.relu(1.0 - lr_).mean() + F.relu(1.0 + lf_).mean())
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()
            else:
                d_loss = torch.zeros((), device=device)

            step += 1
            if step % cfg.train.log_every == 0:
                vals = torch.stack([nll.detach(), qloss.detach(), g_loss.detach(), d_loss.detach()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if tb is not None:
                    for k, v in zip(["nll", "qloss", "g_loss", "d_loss"], vals.tolist()):
                        tb.add_scalar(f"train/{k}", v, step)

        l1, lp, used = validate(ae, perceptual, val_dl, device, cfg.model.n_embed)
        if rank == 0:
            tb.add_scalar("val/l1", l1, step)
            tb.add_scalar("val/lpips", lp, step)
            tb.add_scalar("val/codes_used", used, step)
            print(f"epoch {epoch} step {step} val l1 {l1:.4f} lpips {lp:.4f} codes {used}/{cfg.model.n_embed}",
                  flush=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"ae": ae.module.state_dict(), "disc": disc.module.state_dict(),
                        "opt_ae": opt_ae.state_dict(), "opt_d": opt_d.state_dict(),
                        "step": step, "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
