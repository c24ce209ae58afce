"""Fine-tune the decoder + quantizer of a pretrained VQGAN on a domain dataset (satellite tiles).
The encoder stays frozen so that codes remain compatible with the existing stage-2 prior.
Mixed precision (fp16).

    torchrun --nproc_per_node=8 09_vqgan_domain_finetune.py --cfg cfg/vqgan_sat_ft.yaml
"""
import argparse
import logging
import os
import sys

import lpips
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lab_data.tiles import GeoTiles
from lab_models.vqgan import VQGAN, PatchGAN

log = logging.getLogger("vqgan_ft")


def setup_logging(rank):
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(stream=sys.stdout, level=level,
                        format=f"%(asctime)s [r{rank}] %(levelname)s %(message)s")


def hinge_d(real, fake):
    return 0.5 * (F.relu(1 - real).mean() + F.relu(1 + fake).mean())


def save(path, step, g, d, og, od, scaler):
    torch.save({"step": step, "g": g.module.state_dict(), "d": d.module.state_dict(),
                "og": og.state_dict(), "od": od.state_dict(), "scaler": scaler.state_dict()}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    setup_logging(rank)

    ds = GeoTiles(cfg["data_root"], size=cfg["size"], bands=("R", "G", "B"))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                    pin_memory=True, drop_last=True)

    g = VQGAN.from_pretrained(cfg["init_ckpt"], map_location="cpu").to(dev)
    d = PatchGAN(n_layers=3, norm="group").to(dev)
    g.encoder.requires_grad_(False)
    g.quant_conv.requires_grad_(False)
    g = DDP(g, device_ids=[local_rank])
    d = DDP(d, device_ids=[local_rank])
    perc = lpips.LPIPS(net="vgg").to(dev).eval().requires_grad_(False)

    og = torch.optim.Adam([p for p in g.parameters() if p.requires_grad], lr=cfg["lr"], betas=(0.5, 0.9))
    od = torch.optim.Adam(d.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))
    scaler = GradScaler()

    step = 0
    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(dev, non_blocking=True)

            with autocast():
                xr, qloss, _ = g(x)
                rec = (xr - x).abs().mean()
                p = perc(xr.float(), x).mean()
                g_adv = -d(xr).mean()
                loss = rec + cfg["lpips_w"] * p + qloss + cfg["adv_w"] * g_adv

            if not torch.isfinite(loss):
                log.warning("non-finite generator loss at step %d (rec=%.4f lpips=%.4f q=%.4f), skipping batch",
                            step, rec.item(), p.item(), qloss.item())
                og.zero_grad(set_to_none=True)
                continue

            og.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(og)
            torch.nn.utils.clip_grad_norm_(g.parameters(), cfg["clip"])
            scaler.step(og)

            with autocast():
                logits = d(torch.cat([x, xr.detach()]))
                d_loss = hinge_d(*logits.chunk(2))
            od.zero_grad(set_to_none=True)
            scaler.scale(d_loss).backward()
            scaler.step(od)
            scaler.update()
            step += 1

            if step % cfg["log_every"] == 0:
                t = torch.stack([rec.detach(), p.detach(), qloss.detach(), d_loss.detach()]).float()
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                log.info("ep %d step %d rec %.4f lpips %.4f q %.4f d %.4f scale %.0f",
                         epoch, step, *t.tolist(), scaler.get_scale())
            if step % cfg["ckpt_every"] == 0:
                if rank == 0:
                    save(os.path.join(cfg["out"], f"ft_{step:06d}.pt"), step, g, d, og, od, scaler)
                dist.barrier()

    if rank == 0:
        save(os.path.join(cfg["out"], "ft_final.pt"), step, g, d, og, od, scaler)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
