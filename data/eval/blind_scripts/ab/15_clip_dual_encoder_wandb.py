"""CLIP-style image/text dual encoder on an internal product caption set.

    torchrun --nnodes=2 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29400 15_clip_dual_encoder_wandb.py --cfg clip_s16.yaml

Contrastive loss uses the global batch (features all-gathered with autograd).
"""
import argparse
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer


class PairData(Dataset):
    def __init__(self, csv, img_root, tok, train, max_len=64):
        self.df = pd.read_csv(csv)
        self.root, self.tok, self.max_len = img_root, tok, max_len
        norm = transforms.Normalize((0.481, 0.458, 0.408), (0.269, 0.261, 0.276))
        self.tf = transforms.Compose(
            ([transforms.RandomResizedCrop(224, scale=(0.6, 1.0))] if train else
             [transforms.Resize(224), transforms.CenterCrop(224)]) + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = self.tf(Image.open(os.path.join(self.root, r.image)).convert("RGB"))
        t = self.tok(r.caption, truncation=True, max_length=self.max_len, padding="max_length",
                     return_tensors="pt")
        return img, t["input_ids"][0], t["attention_mask"][0]


class DualEncoder(nn.Module):
    def __init__(self, vision, text, dim):
        super().__init__()
        self.visual = timm.create_model(vision, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text, add_pooling_layer=False)
        self.img_proj = nn.Linear(self.visual.num_features, dim, bias=False)
        self.txt_proj = nn.Linear(self.text.config.hidden_size, dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, ids, mask):
        zi = F.normalize(self.img_proj(self.visual(images)), dim=-1)
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        zt = F.normalize(self.txt_proj(pooled), dim=-1)
        return zi, zt, self.logit_scale.exp().clamp(max=100)


def clip_loss(zi, zt, scale, rank):
    all_i = torch.cat(dist_nn.all_gather(zi), 0)
    all_t = torch.cat(dist_nn.all_gather(zt), 0)
    labels = torch.arange(zi.size(0), device=zi.device) + rank * zi.size(0)
    li = scale * zi @ all_t.t()
    lt = scale * zt @ all_i.t()
    return 0.5 * (F.cross_entropy(li, labels) + F.cross_entropy(lt, labels))


@torch.no_grad()
def retrieval_eval(model, loader, device):
    net = model.module
    net.eval()
    zis, zts = [], []
    for img, ids, mask in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            zi, zt, _ = net(img.to(device), ids.to(device), mask.to(device))
        zis.append(zi.float().cpu())
        zts.append(zt.float().cpu())
    local = (torch.cat(zis), torch.cat(zts))
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    net.train()
    zi = torch.cat([e[0] for e in everything])
    zt = torch.cat([e[1] for e in everything])
    sim = zi @ zt.t()
    gt = torch.arange(sim.size(0))
    i2t = (sim.argmax(1) == gt).float().mean().item()
    t2i = (sim.argmax(0) == gt).float().mean().item()
    return i2t, t2i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    out = cfg["out_dir"]
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "latest.pt")
    ckpt = torch.load(ckpt_path, map_location="cpu") if os.path.exists(ckpt_path) else None

    run_id = ckpt["wandb_id"] if ckpt else wandb.util.generate_id()
    wandb.init(project="clip-products", id=run_id, resume="allow", config=cfg,
               name=f"{cfg['name']}", dir=out)

    tok = AutoTokenizer.from_pretrained(cfg["text_model"])
    train_ds = PairData(cfg["train_csv"], cfg["img_root"], tok, train=True)
    val_ds = PairData(cfg["val_csv"], cfg["img_root"], tok, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0), drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["bs"], sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256, num_workers=6)

    model = DualEncoder(cfg["vision_model"], cfg["text_model"], cfg["embed_dim"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_wd = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    wd = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "logit_scale" in n)]
    opt = torch.optim.AdamW([{"params": wd, "weight_decay": 0.2}, {"params": no_wd, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-6)
    total = cfg["epochs"] * len(train_dl)
    warm = cfg.get("warmup_steps", 2000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    start_epoch, best = 0, 0.0
    if ckpt:
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        del ckpt

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (img, ids, mask) in enumerate(train_dl):
            img, ids, mask = (img.to(device, non_blocking=True), ids.to(device, non_blocking=True),
                              mask.to(device, non_blocking=True))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                zi, zt, scale = model(img, ids, mask)
            loss = clip_loss(zi.float(), zt.float(), scale, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/logit_scale": scale.item(),
                           "lr": sched.get_last_lr()[0],
                           "throughput": (i + 1) * cfg["bs"] * world / (time.time() - t0)},
                          step=epoch * len(train_dl) + i)

        i2t, t2i = retrieval_eval(model, val_dl, device)
        if rank == 0:
            wandb.log({"val/i2t_r1": i2t, "val/t2i_r1": t2i, "epoch": epoch},
                      step=(epoch + 1) * len(train_dl))
            if (i2t + t2i) / 2 > best:
                best = (i2t + t2i) / 2
                torch.save(model.module.state_dict(), os.path.join(out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best,
                        "wandb_id": wandb.run.id}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
