"""Charades text-to-video retrieval with HF Accelerate.

Every Charades video has a variable number of free-form descriptions; training draws one per
visit, evaluation ranks every description against all test videos.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        13_charades_accelerate_retrieval.py --data_dir /data/charades --output_dir out/charades_b16
"""
import argparse
import csv
import math
import os
import random

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from transformers import CLIPModel, CLIPTokenizer, get_cosine_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/data/charades")
    ap.add_argument("--model_name", default="openai/clip-vit-base-patch16")
    ap.add_argument("--num_frames", type=int, default=16)
    ap.add_argument("--per_device_batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--learning_rate", type=float, default=2e-6)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--output_dir", default="out/charades_b16")
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


def split_descriptions(text):
    return [s.strip() for s in text.replace(";", ".").split(".") if len(s.strip().split()) >= 3]


class Charades(Dataset):
    def __init__(self, data_dir, split, num_frames, train):
        self.video_dir = os.path.join(data_dir, "Charades_v1_480")
        self.items = []
        with open(os.path.join(data_dir, f"Charades_v1_{split}.csv")) as f:
            for row in csv.DictReader(f):
                descs = split_descriptions(row["descriptions"])
                if descs:
                    self.items.append((row["id"], descs))
        self.num_frames, self.train = num_frames, train
        self.tf = T.Compose([T.Resize(224, antialias=True),
                             T.RandomCrop(224) if train else T.CenterCrop(224),
                             T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, descs = self.items[i]
        vr = VideoReader(os.path.join(self.video_dir, vid + ".mp4"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        bins = torch.linspace(0, n, self.num_frames + 1)
        if self.train:
            ids = (bins[:-1] + torch.rand(self.num_frames) * (bins[1:] - bins[:-1])).long().clamp(max=n - 1)
        else:
            ids = ((bins[:-1] + bins[1:]) / 2).long().clamp(max=n - 1)
        x = torch.from_numpy(vr.get_batch(ids.tolist()).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        x = self.tf(x)
        if self.train:
            return {"video": x, "text": random.choice(descs)}
        return {"video": x, "texts": descs, "index": i}


def eval_collate(batch):
    return {"video": torch.stack([b["video"] for b in batch]),
            "texts": [t for b in batch for t in b["texts"]],
            "owner": torch.tensor([b["index"] for b in batch for _ in b["texts"]]),
            "index": torch.tensor([b["index"] for b in batch])}


class VideoCLIP(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)

    def encode_video(self, video):
        b, t = video.shape[:2]
        f = self.clip.get_image_features(pixel_values=video.flatten(0, 1)).view(b, t, -1)
        return F.normalize(f.mean(1), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        return F.normalize(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask), dim=-1)

    def forward(self, video, input_ids, attention_mask):
        return self.encode_video(video), self.encode_text(input_ids, attention_mask), self.clip.logit_scale.exp()


@torch.no_grad()
def evaluate(accelerator, model, loader, tokenizer):
    net = accelerator.unwrap_model(model)
    net.eval()
    vids, vid_idx, txts, owners = [], [], [], []
    for batch in loader:
        enc = tokenizer(batch["texts"], padding=True, truncation=True, max_length=64,
                        return_tensors="pt").to(accelerator.device)
        v = net.encode_video(batch["video"])
        t = net.encode_text(enc.input_ids, enc.attention_mask)
        vids.append(accelerator.gather_for_metrics(v))
        vid_idx.append(accelerator.gather_for_metrics(batch["index"]))
        txts.append(accelerator.gather(t))
        owners.append(accelerator.gather(batch["owner"]))
    net.train()
    V, vi = torch.cat(vids), torch.cat(vid_idx)
    Tt, ow = torch.cat(txts), torch.cat(owners)
    # map dataset index -> column
    col = torch.full((int(vi.max()) + 1,), -1, dtype=torch.long, device=V.device)
    col[vi] = torch.arange(len(vi), device=V.device)
    sim = Tt.float() @ V.float().t()
    gt = col[ow]
    r = (sim > sim.gather(1, gt[:, None])).sum(1).float()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1}


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed, device_specific=True)
    accelerator.init_trackers("charades_retrieval", config=vars(args))

    tokenizer = CLIPTokenizer.from_pretrained(args.model_name)
    train_set = Charades(args.data_dir, "train", args.num_frames, train=True)
    test_set = Charades(args.data_dir, "test", args.num_frames, train=False)
    train_loader = DataLoader(train_set, batch_size=args.per_device_batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=16, shuffle=False, num_workers=8, collate_fn=eval_collate)

    model = VideoCLIP(args.model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.2)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    total = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            enc = tokenizer(batch["text"], padding="max_length", truncation=True, max_length=64,
                            return_tensors="pt").to(accelerator.device)
            v, t, scale = model(batch["video"], enc.input_ids, enc.attention_mask)
            v_all = torch.cat(dist_nn.all_gather(v.float()))
            t_all = torch.cat(dist_nn.all_gather(t.float()))
            logits = scale * t_all @ v_all.t()
            y = torch.arange(logits.shape[0], device=logits.device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 50 == 0:
                accelerator.log({"train/loss": loss.item(), "train/scale": scale.item()}, step=step)
                logger.info(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f}")

        metrics = evaluate(accelerator, model, test_loader, tokenizer)
        accelerator.log({f"test/{k}": v for k, v in metrics.items()}, step=step)
        logger.info(f"epoch {epoch} t2v {metrics}")
        if metrics["R@1"] > best:
            best = metrics["R@1"]
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                accelerator.save(accelerator.unwrap_model(model).state_dict(),
                                 os.path.join(args.output_dir, "best_model.bin"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
