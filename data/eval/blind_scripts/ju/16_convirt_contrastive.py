"""ConVIRT-style image-report contrastive pretraining (ResNet-50 / ClinicalBERT) used to
initialise the visual encoder of the report generator.

Negatives are taken from the whole global batch (embeddings gathered across GPUs).

    torchrun --nproc_per_node=4 16_convirt_contrastive.py --data data/mimic_pairs.csv --epochs 50
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer


def parse_args():
    parser = argparse.ArgumentParser(description="ConVIRT pretraining")
    parser.add_argument("--data", required=True)
    parser.add_argument("--image-root", default="/data/mimic-cxr-jpg/2.0.0")
    parser.add_argument("--bert", default="emilyalsentzer/Bio_ClinicalBERT")
    parser.add_argument("--output", default="pretrain/convirt")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--lam", type=float, default=0.75)
    parser.add_argument("--proj-dim", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PairDataset(Dataset):
    def __init__(self, csv, root, tokenizer):
        self.df = pd.read_csv(csv)
        self.root = root
        self.tok = tokenizer
        self.tf = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
            transforms.RandomAffine(20, translate=(0.1, 0.1), scale=(0.95, 1.05)),
            transforms.ColorJitter(brightness=0.4, contrast=0.4),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = self.tf(Image.open(os.path.join(self.root, row.image)).convert("RGB"))
        # ConVIRT samples one sentence from the report as the text view
        sents = [s.strip() for s in str(row.report).split(".") if len(s.strip()) > 3] or [str(row.report)]
        text = random.choice(sents)
        enc = self.tok(text, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
        return img, enc.input_ids[0], enc.attention_mask[0]


class ConVIRT(nn.Module):
    def __init__(self, bert_name, dim):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        resnet.fc = nn.Identity()
        self.image_encoder = resnet
        self.text_encoder = AutoModel.from_pretrained(bert_name, add_pooling_layer=False)
        for layer in self.text_encoder.encoder.layer[:6]:
            layer.requires_grad_(False)
        self.text_encoder.embeddings.requires_grad_(False)
        self.img_proj = nn.Sequential(nn.Linear(2048, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.txt_proj = nn.Sequential(nn.Linear(768, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, img, ids, mask):
        v = self.img_proj(self.image_encoder(img))
        h = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        u = self.txt_proj((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))
        return F.normalize(v, dim=-1), F.normalize(u, dim=-1)


def convirt_loss(v, u, tau, lam, rank):
    # gather with autograd support so every rank gets gradients for its own samples
    v_all = torch.cat(dist_nn.all_gather(v), 0)
    u_all = torch.cat(dist_nn.all_gather(u), 0)
    n = v.size(0)
    targets = torch.arange(n, device=v.device) + rank * n
    l_v2u = F.cross_entropy(v @ u_all.t() / tau, targets)
    l_u2v = F.cross_entropy(u @ v_all.t() / tau, targets)
    return lam * l_v2u + (1 - lam) * l_u2v


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tokenizer = AutoTokenizer.from_pretrained(args.bert)
    dataset = PairDataset(args.data, args.image_root, tokenizer)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = ConVIRT(args.bert, args.proj_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{len(dataset)} pairs, world size {world}, global batch {args.batch_size * world}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(2, device=device)
        start = time.time()
        for step, (img, ids, mask) in enumerate(loader):
            img = img.to(device, non_blocking=True)
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, u = model(img, ids, mask)
            loss = convirt_loss(v.float(), u.float(), args.tau, args.lam, rank)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([loss.detach(), torch.ones_like(loss)])
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        dist.all_reduce(meter)
        if rank == 0:
            print(f"== epoch {epoch} mean loss {(meter[0] / meter[1]).item():.4f} ({time.time() - start:.0f}s)")
            torch.save({"image_encoder": model.module.image_encoder.state_dict(),
                        "model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.output, f"convirt_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
