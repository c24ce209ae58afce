"""
CLIP ViT-B/16 fine-tune on product photos + titles (image<->text contrastive).
open_clip-style loss: local features vs. features gathered from all GPUs (with grad).

torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR --master_port=29512 \
    14_clip_product_contrastive.py --train_csv data/train.csv --val_csv data/val.csv --out runs/clip-prod
"""
import argparse
import csv
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import CLIPModel, CLIPProcessor


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/clip-vit-base-patch16")
    ap.add_argument("--train_csv", required=True)
    ap.add_argument("--val_csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=256, help="per GPU")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class ImageText(Dataset):
    def __init__(self, csv_path, processor):
        with open(csv_path, newline="", encoding="utf-8") as f:
            self.rows = [(r["filepath"], r["title"]) for r in csv.DictReader(f)]
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, title = self.rows[i]
        pix = self.processor.image_processor(Image.open(path).convert("RGB"), return_tensors="pt")["pixel_values"][0]
        tok = self.processor.tokenizer(title, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        return pix, tok["input_ids"][0], tok["attention_mask"][0], i


def clip_loss(img, txt, logit_scale, rank):
    all_img = torch.cat(dist_nn.all_gather(img), dim=0)
    all_txt = torch.cat(dist_nn.all_gather(txt), dim=0)
    logits_i = logit_scale * img @ all_txt.T
    logits_t = logit_scale * txt @ all_img.T
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels)) / 2


def cosine_lr(opt, base_lr, warmup, total):
    def _step(step):
        lr = base_lr * (step + 1) / warmup if step < warmup else \
            0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * base_lr
        for g in opt.param_groups:
            g["lr"] = lr
        return lr
    return _step


@torch.no_grad()
def retrieval_eval(model, val_ds, rank, world, device):
    # shard without padding, every sample exactly once; gather to rank 0 by index
    shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    loader = DataLoader(shard, batch_size=256, num_workers=4)
    model.eval()
    idx, ie, te = [], [], []
    for pix, ids, mask, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a = model.get_image_features(pixel_values=pix.to(device))
            b = model.get_text_features(input_ids=ids.to(device), attention_mask=mask.to(device))
        ie.append(F.normalize(a.float(), dim=-1).cpu())
        te.append(F.normalize(b.float(), dim=-1).cpu())
        idx.append(i)
    model.train()
    local = (torch.cat(idx), torch.cat(ie), torch.cat(te))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return None
    order = torch.cat([g[0] for g in gathered]).argsort()
    I = torch.cat([g[1] for g in gathered])[order]
    T = torch.cat([g[2] for g in gathered])[order]
    sim = I @ T.T
    gt = torch.arange(sim.shape[0])
    r1_i2t = (sim.argmax(1) == gt).float().mean().item()
    r1_t2i = (sim.argmax(0) == gt).float().mean().item()
    r5_i2t = (sim.topk(5, dim=1).indices == gt[:, None]).any(1).float().mean().item()
    return {"i2t_R@1": r1_i2t, "t2i_R@1": r1_t2i, "i2t_R@5": r5_i2t}


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = CLIPProcessor.from_pretrained(args.model)
    model = CLIPModel.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    train_ds = ImageText(args.train_csv, processor)
    val_ds = ImageText(args.val_csv, processor)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total = len(train_dl) * args.epochs
    set_lr = cosine_lr(opt, args.lr, args.warmup, total)

    start_epoch, step = 0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, step = ck["epoch"], ck["step"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"global batch {args.batch_size * world}, {len(train_dl)} steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for pix, ids, mask, _ in train_dl:
            lr = set_lr(step)
            pix, ids, mask = pix.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = ddp(input_ids=ids, attention_mask=mask, pixel_values=pix, return_loss=False)
            img = F.normalize(out.image_embeds.float(), dim=-1)
            txt = F.normalize(out.text_embeds.float(), dim=-1)
            loss = clip_loss(img, txt, model.logit_scale.exp(), rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", lr, step)
                writer.add_scalar("train/logit_scale", model.logit_scale.exp().item(), step)
                print(f"ep {epoch} step {step} loss {loss.item():.4f} {(time.time()-t0)/50:.3f}s/it", flush=True)
                t0 = time.time()

        metrics = retrieval_eval(model, val_ds, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} val {metrics}", flush=True)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1, "step": step},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "final"))
        processor.save_pretrained(os.path.join(args.out, "final"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
