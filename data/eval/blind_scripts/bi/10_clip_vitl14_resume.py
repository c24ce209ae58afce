"""CLIP ViT-L/14 training with auto-resume (preemptible cluster).

Config is a YAML file; any key can be overridden on the command line as key=value.
Every epoch the state is written to <output_dir>/latest.pt and the job picks it up on restart.
"""
import math
import os
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip

DEFAULTS = OmegaConf.create({
    "model": "ViT-L-14",
    "data": {"train": "/datasets/datacomp_medium/train.parquet", "root": "/datasets/datacomp_medium",
             "workers": 8},
    "optim": {"lr": 4e-4, "wd": 0.2, "beta2": 0.98, "warmup": 4000, "grad_clip": 1.0},
    "batch_size": 96,
    "epochs": 16,
    "output_dir": "/checkpoint/clip_vitl14",
    "log_every": 20,
    "grad_checkpointing": True,
})


class ParquetImageText(Dataset):
    def __init__(self, path, root, transform, tokenizer):
        df = pd.read_parquet(path, columns=["key", "caption"])
        self.keys = df["key"].tolist()
        self.captions = df["caption"].astype(str).tolist()
        self.root, self.transform, self.tokenizer = root, transform, tokenizer

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        key = self.keys[i]
        img = Image.open(os.path.join(self.root, key[:5], key + ".jpg")).convert("RGB")
        return self.transform(img), self.tokenizer([self.captions[i]])[0]


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.labels = {}

    def forward(self, img, txt, scale):
        gi = [torch.zeros_like(img) for _ in range(self.world_size)]
        gt = [torch.zeros_like(txt) for _ in range(self.world_size)]
        dist.all_gather(gi, img)
        dist.all_gather(gt, txt)
        gi[self.rank], gt[self.rank] = img, txt
        logits = scale * torch.cat(gi) @ torch.cat(gt).t()
        n = logits.shape[0]
        if n not in self.labels:
            self.labels[n] = torch.arange(n, device=logits.device)
        labels = self.labels[n]
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return f


def main():
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model, train_tf, _ = open_clip.create_model_and_transforms(cfg.model)
    tokenizer = open_clip.get_tokenizer(cfg.model)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)

    dataset = ParquetImageText(cfg.data.train, cfg.data.root, train_tf, tokenizer)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    params = [p for p in model.parameters() if p.requires_grad]
    gain_or_bias = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "logit_scale" in n)]
    assert len(gain_or_bias) + len(rest) == len(params)
    optimizer = torch.optim.AdamW([{"params": gain_or_bias, "weight_decay": 0.0},
                                   {"params": rest, "weight_decay": cfg.optim.wd}],
                                  lr=cfg.optim.lr, betas=(0.9, cfg.optim.beta2), eps=1e-6)
    total_steps = cfg.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim.warmup, total_steps))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    latest = os.path.join(cfg.output_dir, "latest.pt")
    if os.path.isfile(latest):
        checkpoint = torch.load(latest)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"]
        del checkpoint
        if rank == 0:
            print(f"resumed from {latest} at epoch {start_epoch}", flush=True)

    model = DDP(model, device_ids=[local_rank])
    criterion = ClipLoss(rank, world_size)

    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.output_dir, "config.yaml"))

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_data, t0 = 0.0, time.time()
        end = time.time()
        for i, (images, texts) in enumerate(loader):
            t_data += time.time() - end
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
                loss = criterion(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            end = time.time()
            if rank == 0 and i % cfg.log_every == 0:
                print(f"ep {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} gnorm {grad_norm.item():.2f} "
                      f"scale {scale.item():.1f} data {t_data / (i + 1):.3f}s "
                      f"step {(end - t0) / (i + 1):.3f}s", flush=True)

        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch + 1}
            tmp = latest + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, latest)
            if (epoch + 1) % 4 == 0:
                torch.save(state["model"], os.path.join(cfg.output_dir, f"model_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
