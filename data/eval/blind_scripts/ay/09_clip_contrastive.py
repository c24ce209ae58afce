"""
CLIP ViT-B/16 contrastive training on an image/caption CSV (CC12M-style), global-batch InfoNCE.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        09_clip_contrastive.py --train-csv /shared/cc12m/train.csv --val-csv /shared/cc12m/val.csv \
        --out /shared/runs/clip_b16
"""
import argparse
import csv
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CsvCaptions(Dataset):
    def __init__(self, path, transform, tokenizer):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        self.paths = [r["filepath"] for r in rows]
        self.caps = [r["caption"] for r in rows]
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.transform(Image.open(self.paths[i]).convert("RGB"))
        txt = self.tokenizer([self.caps[i]])[0]
        return img, txt


def clip_loss(img_f, txt_f, logit_scale, gather=True):
    """InfoNCE over the global batch. Gathered features keep their autograd path."""
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        all_img = torch.cat(dist_fn.all_gather(img_f), dim=0)
        all_txt = torch.cat(dist_fn.all_gather(txt_f), dim=0)
        offset = dist.get_rank() * img_f.size(0)
    else:
        all_img, all_txt, offset = img_f, txt_f, 0
    labels = torch.arange(img_f.size(0), device=img_f.device) + offset
    logits_i = logit_scale * img_f @ all_txt.t()
    logits_t = logit_scale * txt_f @ all_img.t()
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot_loss, n, correct = 0.0, 0, 0
    for img, txt in loader:
        img = img.to(device, non_blocking=True)
        txt = txt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img_f, txt_f, scale = model(img, txt)
        img_f, txt_f = img_f.float(), txt_f.float()
        tot_loss += clip_loss(img_f, txt_f, scale).item() * img.size(0)
        correct += ((img_f @ txt_f.t()).argmax(-1) == torch.arange(img.size(0), device=device)).sum().item()
        n += img.size(0)
    model.train()
    return tot_loss / n, correct / n


def cosine(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="ViT-B-16")
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=1, help="epochs")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(device)
    model.set_grad_checkpointing(False)
    ddp = DDP(model, device_ids=[local_rank], bucket_cap_mb=100, gradient_as_bucket_view=True)

    train_ds = CsvCaptions(args.train_csv, train_tf, tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = None
    if rank == 0:
        val_ds = CsvCaptions(args.val_csv, val_tf, tokenizer)
        val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=True)

    total = args.epochs * len(loader)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {args.batch_size * world}, {len(loader)} steps/epoch", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.perf_counter()
        for i, (img, txt) in enumerate(loader):
            for g in opt.param_groups:
                g["lr"] = cosine(step, total, args.warmup, args.lr)
            img = img.to(device, non_blocking=True)
            txt = txt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, scale = ddp(img, txt)
            loss = clip_loss(img_f.float(), txt_f.float(), scale.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / (i + 1)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.4f} scale {scale.item():.1f} "
                          f"{args.batch_size * world / dt:.0f} samples/s", flush=True)

        if rank == 0 and (epoch + 1) % args.eval_every == 0:
            val_loss, i2t_acc = evaluate(model, val_loader, device)
            print(f"epoch {epoch}: val loss {val_loss:.4f} in-batch i2t acc {i2t_acc:.3f}", flush=True)
            torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
