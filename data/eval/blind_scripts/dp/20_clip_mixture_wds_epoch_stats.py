"""CLIP ViT-B/32 on a weighted mixture of webdataset sources (CC3M, CC12M, SBU) with per-epoch stats.

    torchrun --nproc_per_node=8 20_clip_mixture_wds_epoch_stats.py --config mixture_b32.yaml
"""
import argparse
import math
import os
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import webdataset as wds
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

import open_clip

DEFAULT_CFG = {
    "model": "ViT-B-32",
    "sources": [
        {"urls": "/data/wds/cc3m/{00000..00331}.tar", "weight": 1.0},
        {"urls": "/data/wds/cc12m/{00000..01242}.tar", "weight": 3.0},
        {"urls": "/data/wds/sbu/{00000..00099}.tar", "weight": 0.3},
    ],
    "samples_per_epoch": 8_000_000,
    "batch_size": 384,
    "epochs": 24,
    "lr": 7e-4,
    "wd": 0.2,
    "warmup": 2500,
    "workers": 8,
    "out": "runs/mixture_b32",
    "resume": None,
}


def source_pipeline(urls, preprocess, tokenizer):
    return wds.DataPipeline(
        wds.ResampledShards(list(braceexpand.braceexpand(urls))),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(2000, initial=500),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
    )


def build_loader(cfg, preprocess, tokenizer, world):
    sources = [source_pipeline(s["urls"], preprocess, tokenizer) for s in cfg["sources"]]
    weights = [s["weight"] for s in cfg["sources"]]
    mix = wds.RandomMix(sources, weights)
    steps = math.ceil(cfg["samples_per_epoch"] / (cfg["batch_size"] * world))
    per_worker = math.ceil(steps / cfg["workers"])
    ds = wds.DataPipeline(mix, wds.batched(cfg["batch_size"], partial=False)).with_epoch(per_worker)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=cfg["workers"], persistent_workers=True)
    return loader, per_worker * cfg["workers"]


def clip_loss(img, txt, scale):
    all_img = torch.cat(torch.distributed.nn.all_gather(img))
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt))
    logits = scale * all_img @ all_txt.T
    labels = torch.arange(len(logits), device=logits.device)
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    acc = (logits.argmax(1) == labels).float().mean()
    return loss, acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f))
    if a.resume:
        cfg["resume"] = a.resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, preprocess_train, _ = open_clip.create_model_and_transforms(cfg["model"], device=device)
    tokenizer = open_clip.get_tokenizer(cfg["model"])
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n],
          "weight_decay": cfg["wd"]},
         {"params": [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n],
          "weight_decay": 0.0}],
        lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"]
        del ck

    ddp = DDP(model, device_ids=[local_rank])
    loader, steps_per_epoch = build_loader(cfg, preprocess_train, tokenizer, world)
    total = steps_per_epoch * cfg["epochs"]
    warmup = cfg["warmup"]

    def lr_at(s):
        if s < warmup:
            return cfg["lr"] * (s + 1) / warmup
        return 0.5 * cfg["lr"] * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))

    writer = None
    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
        writer = SummaryWriter(cfg["out"])

    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, cfg["epochs"]):
        ddp.train()
        running_loss, running_acc, n_batches = 0.0, 0.0, 0
        data_time, t_end = 0.0, time.time()
        for images, texts in loader:
            data_time += time.time() - t_end
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp(images, texts)
                loss, acc = clip_loss(img, txt, scale)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            running_loss += loss.item()
            running_acc += acc.item()
            n_batches += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/acc", acc.item(), step)
                writer.add_scalar("train/logit_scale", scale.item(), step)
                writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
                print(f"ep {epoch} step {step} loss {loss.item():.4f} acc {acc.item():.3f} "
                      f"data {data_time / n_batches:.3f}s", flush=True)
            t_end = time.time()

        epoch_stats = torch.tensor([running_loss, running_acc, n_batches, data_time], dtype=torch.float64)
        dist.all_reduce(epoch_stats)
        mean_loss = (epoch_stats[0] / epoch_stats[2]).item()
        mean_acc = (epoch_stats[1] / epoch_stats[2]).item()
        mean_data = (epoch_stats[3] / epoch_stats[2]).item()
        if rank == 0:
            writer.add_scalar("epoch/loss", mean_loss, epoch)
            writer.add_scalar("epoch/acc", mean_acc, epoch)
            writer.add_scalar("epoch/data_time", mean_data, epoch)
            print(f"epoch {epoch} loss {mean_loss:.4f} acc {mean_acc:.4f} data {mean_data:.3f}s/batch", flush=True)
            torch.save({"epoch": epoch + 1, "model": model.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "cfg": cfg}, os.path.join(cfg["out"], "checkpoint.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
