"""Small CLIP (ViT-B/16 image tower + DistilBERT text tower) trained on a CSV of image/caption pairs.
Negatives are gathered from all GPUs (local features keep their gradient), as in open_clip.

    torchrun --nproc_per_node=8 train_clip.py --train-csv cc3m_train.csv --val-csv cc3m_val.csv \
        --batch-size 256 --epochs 32 --lr 5e-4
"""
import argparse
import csv
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer


class CsvPairs(Dataset):
    def __init__(self, csv_file, tokenizer, train=True, max_len=64):
        with open(csv_file, newline="") as f:
            rows = list(csv.DictReader(f))
        self.paths = [r["filepath"] for r in rows]
        self.captions = [r["title"] for r in rows]
        self.tok, self.max_len = tokenizer, max_len
        norm = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
        if train:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.9, 1.0)),
                                          transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224),
                                          transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.tf(Image.open(self.paths[i]).convert("RGB"))
        t = self.tok(self.captions[i], max_length=self.max_len, truncation=True, padding="max_length",
                     return_tensors="pt")
        return img, t["input_ids"][0], t["attention_mask"][0]


class CLIP(nn.Module):
    def __init__(self, embed_dim=512, text_model="distilbert-base-uncased"):
        super().__init__()
        self.visual = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=embed_dim)
        self.text = AutoModel.from_pretrained(text_model)
        self.text_proj = nn.Linear(self.text.config.hidden_size, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images, input_ids, attention_mask):
        img = F.normalize(self.visual(images), dim=-1)
        h = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        txt = F.normalize(self.text_proj(h), dim=-1)
        return img, txt, self.logit_scale.exp()


def gather_features(img, txt, rank, world_size):
    all_img = [torch.zeros_like(img) for _ in range(world_size)]
    all_txt = [torch.zeros_like(txt) for _ in range(world_size)]
    dist.all_gather(all_img, img)
    dist.all_gather(all_txt, txt)
    all_img[rank] = img
    all_txt[rank] = txt
    return torch.cat(all_img), torch.cat(all_txt)


def clip_loss(img, txt, scale, rank, world_size):
    all_img, all_txt = gather_features(img, txt, rank, world_size)
    logits_per_image = scale * img @ all_txt.T
    logits_per_text = scale * txt @ all_img.T
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
    return loss, logits_per_image, logits_per_text, labels


@torch.no_grad()
def evaluate(model, loader, device, rank, world_size):
    model.eval()
    correct_i2t = correct_t2i = total = 0
    loss_sum = 0.0
    for images, ids, mask in loader:
        images, ids, mask = images.to(device), ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img, txt, scale = model(images, ids, mask)
            loss, lpi, lpt, labels = clip_loss(img, txt, scale, rank, world_size)
        correct_i2t += (lpi.argmax(1) == labels).sum().item()
        correct_t2i += (lpt.argmax(1) == labels).sum().item()
        total += labels.numel()
        loss_sum += loss.item() * labels.numel()
    stats = torch.tensor([correct_i2t, correct_t2i, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return {"i2t_acc": stats[0].item() / stats[2].item(), "t2i_acc": stats[1].item() / stats[2].item(),
            "val_loss": stats[3].item() / stats[2].item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 2048")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="logs/clip_b16")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained("distilbert-base-uncased")
    train_set = CsvPairs(args.train_csv, tokenizer, train=True)
    val_set = CsvPairs(args.val_csv, tokenizer, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, drop_last=True,
                            sampler=DistributedSampler(val_set, shuffle=False, drop_last=True),
                            num_workers=args.workers)

    model = CLIP().to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": args.wd}],
        lr=args.lr * args.batch_size * world_size / 2048, betas=(0.9, 0.98), eps=1e-6)
    peak_lr = optimizer.param_groups[0]["lr"]
    total_steps = args.epochs * len(train_loader)
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for images, ids, mask in train_loader:
            lr = peak_lr * step / args.warmup if step < args.warmup else \
                0.5 * peak_lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            images, ids, mask = images.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, ids, mask)
                loss, _, _, _ = clip_loss(img, txt, scale, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} (rank 0) "
                      f"scale {scale.item():.2f} lr {lr:.2e}", flush=True)
            step += 1

        metrics = evaluate(model, val_loader, device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} {metrics} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.out, f"epoch_{epoch}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
