"""ViT-L/14 video-text retrieval fine-tuning on MSR-VTT with DeepSpeed ZeRO-2 (bf16).

    deepspeed --num_gpus 8 12_deepspeed_vitl_msrvtt.py --micro_batch 16 --grad_accum 2 --epochs 5
"""
import argparse
import json
import os
import random

import deepspeed
import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/msrvtt")
    p.add_argument("--arch", default="ViT-L-14")
    p.add_argument("--pretrained", default="openai")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--save_dir", default="/ckpt/msrvtt_vitl_ds")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class MSRVTTDataset(Dataset):
    def __init__(self, data_dir, split, frames, tokenizer):
        self.root = os.path.join(data_dir, "videos")
        self.frames, self.tok, self.train = frames, tokenizer, split == "train"
        if self.train:
            ids = set(pd.read_csv(os.path.join(data_dir, "MSRVTT_train.9k.csv"))["video_id"])
            with open(os.path.join(data_dir, "MSRVTT_data.json")) as f:
                self.items = [(s["video_id"], s["caption"]) for s in json.load(f)["sentences"] if s["video_id"] in ids]
        else:
            df = pd.read_csv(os.path.join(data_dir, "MSRVTT_JSFUSION_test.csv"))
            self.items = list(zip(df.video_id, df.sentence))
        self.tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                             T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, cap = self.items[i]
        vr = VideoReader(os.path.join(self.root, vid + ".mp4"), ctx=cpu(0), num_threads=1)
        edges = np.linspace(0, len(vr), self.frames + 1).astype(int)
        if self.train:
            ids = [random.randint(a, max(a, b - 1)) for a, b in zip(edges[:-1], edges[1:])]
        else:
            ids = ((edges[:-1] + edges[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), self.tok([cap])[0], i


class VideoCLIP(nn.Module):
    def __init__(self, arch, pretrained):
        super().__init__()
        self.clip = open_clip.create_model(arch, pretrained=pretrained)
        self.clip.set_grad_checkpointing(True)

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.clip.encode_image(x.flatten(0, 1), normalize=True).view(b, t, -1)
        return F.normalize(f.mean(1), dim=-1)

    def encode_text(self, tokens):
        return self.clip.encode_text(tokens, normalize=True)

    def forward(self, x, tokens):
        return self.encode_video(x), self.encode_text(tokens), self.clip.logit_scale.exp()


@torch.no_grad()
def evaluate(engine, loader, n, device):
    net = engine.module
    net.eval()
    rows = []
    for x, tok, idx in loader:
        x = x.to(device, dtype=torch.bfloat16)
        v, t = net.encode_video(x).float(), net.encode_text(tok.to(device)).float()
        rows.append(torch.cat([v, t, idx.to(device, torch.float32)[:, None]], 1))
    local = torch.cat(rows)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    allr = torch.cat(parts)
    d = (local.shape[1] - 1) // 2
    table = torch.zeros(n, 2 * d, device=device)
    table[allr[:, -1].long()] = allr[:, :-1]
    sim = table[:, d:] @ table[:, :d].t()
    net.train()
    out = {}
    for name, s in (("t2v", sim), ("v2t", sim.t())):
        r = (s > s.diag()[:, None]).sum(1).float()
        out.update({f"{name}_R@{k}": 100 * (r < k).float().mean().item() for k in (1, 5, 10)})
        out[f"{name}_MdR"] = r.median().item() + 1
    return out


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    tokenizer = open_clip.get_tokenizer(args.arch)
    train_set = MSRVTTDataset(args.data_dir, "train", args.frames, tokenizer)
    test_set = MSRVTTDataset(args.data_dir, "test", args.frames, tokenizer)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=32, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=8)

    steps = len(train_loader) // args.grad_accum * args.epochs
    ds_config = {
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                                  "weight_decay": 0.2}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps,
                                                           "warmup_num_steps": int(0.1 * steps)}},
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
    }
    model = VideoCLIP(args.arch, args.pretrained)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_epoch = 0
    if os.path.isdir(args.save_dir) and os.path.exists(os.path.join(args.save_dir, "latest")):
        _, client = engine.load_checkpoint(args.save_dir)
        start_epoch = client["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for it, (x, tok, _) in enumerate(train_loader):
            x = x.to(device, dtype=torch.bfloat16, non_blocking=True)
            tok = tok.to(device, non_blocking=True)
            v, t, scale = engine(x, tok)
            v_all = torch.cat(dist_fn.all_gather(v.float()))
            t_all = torch.cat(dist_fn.all_gather(t.float()))
            logits = scale.float() * t_all @ v_all.t()
            y = torch.arange(logits.shape[0], device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            engine.backward(loss)
            engine.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e}", flush=True)

        metrics = evaluate(engine, test_loader, len(test_set), device)
        if rank == 0:
            print(f"epoch {epoch} {json.dumps(metrics)}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch, "metrics": metrics})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
