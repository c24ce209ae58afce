"""TimeSformer (K400) video tower + BERT text tower, trained for text-video retrieval on MSR-VTT.

    torchrun --nproc_per_node=8 17_timesformer_bert_dual.py --cfg configs/timesformer_bert.json
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import BertModel, BertTokenizerFast, TimesformerModel

DEFAULT_CFG = {
    "data_dir": "/data/msrvtt",
    "video_model": "facebook/timesformer-base-finetuned-k400",
    "text_model": "bert-base-uncased",
    "num_frames": 8,
    "embed_dim": 256,
    "batch_size": 24,
    "epochs": 10,
    "lr": 3e-5,
    "proj_lr": 3e-4,
    "warmup_ratio": 0.1,
    "init_temp": 0.05,
    "output_dir": "/ckpt/timesformer_bert",
    "num_workers": 8,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(json.load(f))
    return cfg


class MSRVTTRetrieval(Dataset):
    def __init__(self, cfg, split, tokenizer):
        root = cfg["data_dir"]
        self.video_dir, self.n, self.tok, self.train = os.path.join(root, "videos"), cfg["num_frames"], tokenizer, \
            split == "train"
        if self.train:
            keep = set(pd.read_csv(os.path.join(root, "MSRVTT_train.9k.csv"))["video_id"])
            with open(os.path.join(root, "MSRVTT_data.json")) as f:
                self.items = [(s["video_id"], s["caption"]) for s in json.load(f)["sentences"] if s["video_id"] in keep]
        else:
            df = pd.read_csv(os.path.join(root, "MSRVTT_JSFUSION_test.csv"))
            self.items = list(zip(df["video_id"], df["sentence"]))
        crop = T.RandomResizedCrop(224, scale=(0.6, 1.0), antialias=True) if self.train else T.Compose(
            [T.Resize(224, antialias=True), T.CenterCrop(224)])
        self.tf = T.Compose([crop, T.Normalize((0.45, 0.45, 0.45), (0.225, 0.225, 0.225))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, cap = self.items[i]
        vr = VideoReader(os.path.join(self.video_dir, f"{vid}.mp4"), ctx=cpu(0), num_threads=1)
        seg = np.linspace(0, len(vr), self.n + 1).astype(int)
        if self.train:
            ids = [random.randint(a, max(a, b - 1)) for a, b in zip(seg[:-1], seg[1:])]
        else:
            ids = ((seg[:-1] + seg[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        enc = self.tok(cap, max_length=32, truncation=True, padding="max_length", return_tensors="pt")
        return self.tf(x), enc["input_ids"][0], enc["attention_mask"][0]


class DualEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.video_encoder = TimesformerModel.from_pretrained(cfg["video_model"])
        self.text_encoder = BertModel.from_pretrained(cfg["text_model"])
        self.video_proj = nn.Linear(self.video_encoder.config.hidden_size, cfg["embed_dim"])
        self.text_proj = nn.Linear(self.text_encoder.config.hidden_size, cfg["embed_dim"])
        self.log_temp = nn.Parameter(torch.tensor(math.log(cfg["init_temp"])))

    def encode_video(self, video):
        h = self.video_encoder(pixel_values=video).last_hidden_state[:, 0]
        return F.normalize(self.video_proj(h), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        h = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return F.normalize(self.text_proj(h), dim=-1)

    def forward(self, video, input_ids, attention_mask):
        return self.encode_video(video), self.encode_text(input_ids, attention_mask), self.log_temp.exp()


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.r, ctx.b = dist.get_rank(), x.size(0)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.r * ctx.b:(ctx.r + 1) * ctx.b]


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    vs, ts = [], []
    for video, ids, mask in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            vs.append(net.encode_video(video.to(device)).float())
            ts.append(net.encode_text(ids.to(device), mask.to(device)).float())
    net.train()
    sim = torch.cat(ts) @ torch.cat(vs).t()
    rank = (sim > sim.diag()[:, None]).sum(1).float()
    return {f"R@{k}": 100 * (rank < k).float().mean().item() for k in (1, 5, 10)} | {"MdR": rank.median().item() + 1}


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    tok = BertTokenizerFast.from_pretrained(cfg["text_model"])
    train_ds = MSRVTTRetrieval(cfg, "train", tok)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True)
    test_loader = None
    if rank == 0:
        test_loader = DataLoader(MSRVTTRetrieval(cfg, "test", tok), 32, shuffle=False, num_workers=cfg["num_workers"])

    model = DualEncoder(cfg).to(device)
    enc_params = [p for n, p in model.named_parameters() if n.startswith(("video_encoder.", "text_encoder."))]
    head_params = [p for n, p in model.named_parameters() if not n.startswith(("video_encoder.", "text_encoder."))]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": cfg["lr"]}, {"params": head_params, "lr": cfg["proj_lr"]}],
                            weight_decay=0.05)
    model = DDP(model, device_ids=[local_rank])
    total = cfg["epochs"] * len(loader)
    warm = int(cfg["warmup_ratio"] * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (video, ids, mask) in enumerate(loader):
            video, ids, mask = video.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t, temp = model(video, ids, mask)
            v, t = AllGather.apply(v.float()), AllGather.apply(t.float())
            logits = t @ v.t() / temp
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}:{it}/{len(loader)}] loss {loss.item():.4f} temp {temp.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if rank == 0:
            res = evaluate(model.module, test_loader, device)
            print(f"epoch {epoch} MSR-VTT 1k-A t2v {res}", flush=True)
            os.makedirs(cfg["output_dir"], exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(cfg["output_dir"], "last.pth"))
            if res["R@1"] > best:
                best = res["R@1"]
                torch.save(model.module.state_dict(), os.path.join(cfg["output_dir"], "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
