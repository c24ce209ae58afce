#!/usr/bin/env python3
"""Train ECAPA-TDNN (C=512) for on-device verification, then export the best
encoder to ONNX together with its Vox1-O EER.

    torchrun --nproc_per_node=8 17_ecapa_train_export_onnx.py --cfg conf/ecapa512.json
"""
import argparse
import json
import logging
import os
import random
import shutil
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sv.model import ECAPATDNN, AAMSoftmax
from sv.metrics import eer_mindcf

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
log = logging.getLogger(__name__)


class Wrapper(nn.Module):
    def __init__(self, n_spk, C, emb_dim, margin, scale):
        super().__init__()
        self.encoder = ECAPATDNN(C=C, emb_dim=emb_dim)
        self.head = AAMSoftmax(emb_dim, n_spk, m=margin, s=scale)

    def forward(self, wav, label):
        return self.head(self.encoder(wav), label)


class ListDataset(Dataset):
    def __init__(self, list_path, spk2id_path, crop):
        self.spk2id = {s: int(i) for s, i in (l.split() for l in open(spk2id_path))}
        self.items = [(p, self.spk2id[s]) for p, s in (l.split() for l in open(list_path))]
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        n = sf.info(path).frames
        off = random.randint(0, max(0, n - self.crop))
        x, _ = sf.read(path, start=off, frames=self.crop, dtype="float32")
        if len(x) < self.crop:
            x = np.pad(x, (0, self.crop - len(x)), mode="wrap")
        return torch.from_numpy(x), y


@torch.no_grad()
def embed_all(encoder, utts, root, device, rank, world):
    encoder.eval()
    mine = {}
    for u in utts[rank::world]:
        x, _ = sf.read(os.path.join(root, u), dtype="float32")
        mine[u] = F.normalize(encoder(torch.from_numpy(x)[None].to(device)), dim=-1)[0].cpu()
    out = [None] * world
    dist.all_gather_object(out, mine)
    return {k: v for d in out for k, v in d.items()}


def vox1o(encoder, cfg, device, rank, world):
    trials = [l.split() for l in open(cfg["trials"])]
    utts = sorted({u for t in trials for u in t[1:]})
    emb = embed_all(encoder, utts, cfg["vox1_root"], device, rank, world)
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([int(t[0]) for t in trials])
    return eer_mindcf(scores, labels)


def export_best(cfg, device):
    ckpt = torch.load(os.path.join(cfg["exp"], "best.pt"), map_location="cpu")
    encoder = ECAPATDNN(C=cfg["channels"], emb_dim=cfg["emb_dim"])
    enc_state = {k[len("encoder."):]: v for k, v in ckpt["model"].items() if k.startswith("encoder.")}
    encoder.load_state_dict(enc_state)
    encoder.eval().to(device)
    dummy = torch.randn(1, 3 * 16000, device=device)
    onnx_path = os.path.join(cfg["exp"], "ecapa512.onnx")
    torch.onnx.export(encoder, dummy, onnx_path, input_names=["wav"], output_names=["embedding"],
                      dynamic_axes={"wav": {0: "batch", 1: "samples"}, "embedding": {0: "batch"}},
                      opset_version=17)
    with open(os.path.join(cfg["exp"], "model_card.json"), "w") as f:
        json.dump({"epoch": ckpt["epoch"], "vox1_O_eer": ckpt["eer"], "onnx": os.path.basename(onnx_path)}, f)
    log.info("exported %s (epoch %d, EER %.3f%%)", onnx_path, ckpt["epoch"], ckpt["eer"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", action="store_true")
    cfg = json.load(open(ap.parse_args().cfg))
    args_resume = ap.parse_args().resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        log.setLevel(logging.WARNING)

    ds = ListDataset(cfg["train_list"], cfg["spk2id"], int(cfg["crop_sec"] * 16000))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=cfg["workers"],
                    pin_memory=True, drop_last=True, persistent_workers=True)

    model = Wrapper(len(ds.spk2id), cfg["channels"], cfg["emb_dim"], cfg["margin"], cfg["scale"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / 256
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg["lr_step_epochs"], gamma=cfg["lr_gamma"])

    start, best_eer = 0, float("inf")
    last_path = os.path.join(cfg["exp"], "last.pt")
    if args_resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start, best_eer = ckpt["epoch"] + 1, ckpt["best_eer"]
        log.info("resumed at epoch %d", start)
    if rank == 0:
        os.makedirs(cfg["exp"], exist_ok=True)

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for i, (wav, y) in enumerate(dl):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, prec = model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), prec.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        eer, dcf = vox1o(model.module.encoder, cfg, device, rank, world)
        log.info("epoch %d loss %.4f acc %.2f%% lr %.2e | Vox1-O EER %.3f%% minDCF %.4f | %.0fs", epoch,
                 acc[0] / acc[2], 100 * acc[1] / acc[2], sched.get_last_lr()[0], eer, dcf, time.time() - t0)
        if rank == 0:
            is_best = eer < best_eer
            best_eer = min(eer, best_eer)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "eer": eer, "best_eer": best_eer}, last_path)
            if is_best:
                shutil.copyfile(last_path, os.path.join(cfg["exp"], "best.pt"))
        dist.barrier()

    if rank == 0:
        export_best(cfg, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
