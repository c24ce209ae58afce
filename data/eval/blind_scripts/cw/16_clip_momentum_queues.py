"""Cross-modal momentum contrast on product image/title pairs.

Online CLIP encoders are trained against keys from momentum copies; keys of every rank go into
an image queue and a title queue (MoCo-style), which act as extra negatives for both directions.

    torchrun --standalone --nproc_per_node=8 16_clip_momentum_queues.py \
        --train-file data/pairs_train.jsonl --val-file data/pairs_val.jsonl --image-dir /data/imgs
"""
import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPModel, CLIPProcessor, get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--val-file", required=True)
    parser.add_argument("--image-dir", required=True)
    parser.add_argument("--model", default="openai/clip-vit-base-patch16")
    parser.add_argument("--output-dir", default="outputs/clip_mq")
    parser.add_argument("--per-device-batch", type=int, default=96)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--queue-size", type=int, default=24576)
    parser.add_argument("--momentum", type=float, default=0.995)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PairSet(Dataset):
    def __init__(self, path, image_dir):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return Image.open(os.path.join(self.image_dir, r["image"])).convert("RGB"), r["title"], i


class Collator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        images, titles, idx = zip(*batch)
        enc = self.processor(text=list(titles), images=list(images), return_tensors="pt",
                             padding="max_length", truncation=True, max_length=77)
        return enc["pixel_values"], enc["input_ids"], enc["attention_mask"], torch.tensor(idx)


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


class MomentumCLIP(nn.Module):
    def __init__(self, name, queue_size, momentum):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)
        self.clip_m = copy.deepcopy(self.clip)
        for p in self.clip_m.parameters():
            p.requires_grad = False
        dim = self.clip.config.projection_dim
        self.m, self.K = momentum, queue_size
        self.register_buffer("img_queue", F.normalize(torch.randn(queue_size, dim), dim=1))
        self.register_buffer("txt_queue", F.normalize(torch.randn(queue_size, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def encode(self, clip, pixels, ids, mask):
        img = F.normalize(clip.get_image_features(pixel_values=pixels), dim=-1)
        txt = F.normalize(clip.get_text_features(input_ids=ids, attention_mask=mask), dim=-1)
        return img, txt

    def forward(self, pixels, ids, mask):
        img, txt = self.encode(self.clip, pixels, ids, mask)
        with torch.no_grad():
            for p, pm in zip(self.clip.parameters(), self.clip_m.parameters()):
                pm.mul_(self.m).add_(p.detach(), alpha=1 - self.m)
            img_k, txt_k = self.encode(self.clip_m, pixels, ids, mask)
        scale = self.clip.logit_scale.exp().clamp(max=100)
        # positives are the momentum keys of the paired sample, negatives the queue
        i2t = torch.cat([(img * txt_k).sum(1, keepdim=True), img @ self.txt_queue.clone().T], 1) * scale
        t2i = torch.cat([(txt * img_k).sum(1, keepdim=True), txt @ self.img_queue.clone().T], 1) * scale
        zeros = torch.zeros(img.shape[0], dtype=torch.long, device=img.device)
        loss = 0.5 * (F.cross_entropy(i2t, zeros) + F.cross_entropy(t2i, zeros))
        self._enqueue(img_k, txt_k)
        return loss

    @torch.no_grad()
    def _enqueue(self, img_k, txt_k):
        img_k, txt_k = concat_all_gather(img_k), concat_all_gather(txt_k)
        n = img_k.shape[0]
        slots = (self.ptr + torch.arange(n, device=img_k.device)) % self.K
        self.img_queue[slots] = img_k
        self.txt_queue[slots] = txt_k
        self.ptr.copy_((self.ptr + n) % self.K)


@torch.no_grad()
def evaluate(model, loader, n, device, ks=(1, 5, 10)):
    model.eval()
    img_f, txt_f, idx = [], [], []
    for pixels, ids, mask, i in loader:
        im, tx = model.encode(model.clip, pixels.to(device), ids.to(device), mask.to(device))
        img_f.append(im)
        txt_f.append(tx)
        idx.append(i.to(device))
    img_f, txt_f = concat_all_gather(torch.cat(img_f)), concat_all_gather(torch.cat(txt_f))
    idx = concat_all_gather(torch.cat(idx))
    gallery_img = torch.zeros(n, img_f.shape[1], device=device)
    gallery_txt = torch.zeros_like(gallery_img)
    gallery_img[idx], gallery_txt[idx] = img_f, txt_f
    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.arange(rank, n, world, device=device)
    out = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for j, (a, b) in enumerate(((gallery_txt, gallery_img), (gallery_img, gallery_txt))):
        top = (a[q] @ b.T).topk(max(ks), dim=1).indices
        hit = top == q[:, None]
        for t, k in enumerate(ks):
            out[j * len(ks) + t] = hit[:, :k].any(1).sum()
    out[-1] = len(q)
    dist.all_reduce(out)
    model.train()
    names = [f"t2i_R@{k}" for k in ks] + [f"i2t_R@{k}" for k in ks]
    return {name: (100 * out[j] / out[-1]).item() for j, name in enumerate(names)}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    processor = CLIPProcessor.from_pretrained(args.model)
    collate = Collator(processor)
    train_set = PairSet(args.train_file, args.image_dir)
    val_set = PairSet(args.val_file, args.image_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.per_device_batch, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.num_workers, collate_fn=collate)

    model = MomentumCLIP(args.model, args.queue_size, args.momentum).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
    # lr given for 8 x 96 pairs
    lr = args.lr * args.per_device_batch * world / 768
    optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=lr, weight_decay=0.2)
    total = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for pixels, ids, mask, _ in train_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(pixels.to(device, non_blocking=True), ids.to(device), mask.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_loader, len(val_set), device)
        if rank == 0:
            print(f"epoch {epoch} " + json.dumps({k: round(v, 2) for k, v in metrics.items()}), flush=True)
            score = metrics["t2i_R@1"] + metrics["i2t_R@1"]
            if score > best:
                best = score
                model.clip.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
